"""``pin_prefix`` with a text prefix while the engine stops: its tokenizing goes to the intake's
worker thread, which closes when the intake actor stops, and that happens before the engine
marks itself closed or dead (a failing engine's actors stop first, then ``_fail`` runs). A call
that passed the engine's alive check in that window got the worker thread's bare RuntimeError
(a prefix of token ids: anyio's BrokenResourceError from the scheduler's inbox); it gets the
engine's :class:`EngineClosedError` (the cause chained). So does ``generate`` in that window
(the intake's closed inbox)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncpaged.engine.async_engine as engine_module
from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.actors.worker_thread import WorkerThread, WorkerThreadClosedError
from asyncpaged.errors import EngineClosedError, EngineDeadError
from tests.engine.conftest import running_engine

pytestmark = pytest.mark.anyio

MODEL = "llama-gqa"
TEXT = "the quick brown fox jumps over the lazy dog " * 8


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _first_step(coro: Coroutine[Any, Any, Any]) -> BaseException:
    """What ``coro`` raises before its first suspension (it must not suspend)."""
    try:
        coro.send(None)
    except BaseException as exc:
        return exc
    coro.close()
    raise AssertionError("the call suspended instead of failing at once")


async def test_a_closed_worker_raises_its_own_runtime_error() -> None:
    worker = WorkerThread("test-worker")
    worker.close()
    with pytest.raises(WorkerThreadClosedError, match="closed") as info:
        await worker.run(lambda: None)
    assert isinstance(info.value, RuntimeError)  # what callers that know no better catch


async def test_pin_prefix_after_the_intake_stopped_raises_engine_closed(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The intake's thread closed (its actor stopped) while the engine still looks alive."""
    with anyio.fail_after(60):
        async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=16) as engine:
            engine._intake.thread.close()
            with pytest.raises(EngineClosedError, match="not running") as info:
                await engine.pin_prefix(TEXT)
            assert isinstance(info.value.__cause__, WorkerThreadClosedError)


@pytest.mark.parametrize("prefix", [TEXT, list(range(20, 68))], ids=["text", "token_ids"])
async def test_pin_prefix_in_the_window_before_a_failing_engine_is_dead(
    prefix: str | list[int],
    tiny_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real window: a step fails, the actors stop (the intake's thread and the actors'
    inboxes with them), and only then does the supervisor mark the engine dead. A pin_prefix
    made at that exact point (from the hook, before ``_fail`` runs) passes the alive check and
    must still get EngineClosedError (a text: the thread's error; token ids: the scheduler's
    closed inbox); once the engine is dead, later calls get EngineDeadError."""
    seen: list[BaseException] = []
    left_live: set[str] = set()  # live after the window's generate: must be none
    fail = AsyncEngine._fail

    def fail_after_pinning(self: AsyncEngine, exc: BaseException) -> None:
        if not seen:
            assert self._dead is None and not self._closed, "not the window"
            assert self._intake.thread._closed, "the intake's thread is still open"
            seen.append(_first_step(self.pin_prefix(prefix)))
            assert self._outputs is not None
            before = set(self._outputs.live)
            try:  # recorded, not asserted here: the engine must still be failed below
                self.generate([5, 6, 7], SamplingParams(max_tokens=2))
            except BaseException as submitted:
                seen.append(submitted)
            left_live.update(set(self._outputs.live) - before)
        fail(self, exc)

    monkeypatch.setattr(engine_module.AsyncEngine, "_fail", fail_after_pinning)
    config = EngineConfig(model=str(tiny_checkpoint(MODEL)), dtype="float32",
                          num_device_blocks=16)  # fmt: skip
    with anyio.fail_after(60):
        engine = await AsyncEngine.start(config)

        class BrokenRunner:
            def execute(self, plan: object) -> None:
                raise RuntimeError("injected step failure")

        engine._executor.runner = BrokenRunner()  # type: ignore[assignment]
        greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        with pytest.raises(EngineDeadError):
            await engine.generate([5, 6, 7], greedy)
        with pytest.raises(EngineDeadError):
            await engine.pin_prefix(TEXT)
        with pytest.raises(EngineDeadError):
            await engine.aclose()
    assert len(seen) == 2, seen
    assert isinstance(seen[0], EngineClosedError), repr(seen[0])
    assert isinstance(seen[1], EngineClosedError), repr(seen[1])  # generate, not queued
    assert isinstance(seen[1].__cause__, anyio.BrokenResourceError), repr(seen[1].__cause__)
    assert not left_live
    cause = WorkerThreadClosedError if isinstance(prefix, str) else anyio.BrokenResourceError
    assert isinstance(seen[0].__cause__, cause), repr(seen[0].__cause__)
