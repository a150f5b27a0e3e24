"""The engine's lifecycle: ``start``/``aclose`` from any task (notebook cells), a second start
refused at once, calls after close, and nothing kept alive once an engine is closed."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import asyncpaged.engine.async_engine as engine_module
from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.errors import EngineClosedError, EngineDeadError
from tests.engine.conftest import assert_no_leaks

pytestmark = pytest.mark.anyio

MODEL = "llama-gqa"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", num_device_blocks=16)


async def _in_own_task(fn: Callable[[], object]) -> None:
    """Run ``fn`` (an async callable) in a task of its own that has ended when this returns,
    as a notebook cell is."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(fn)  # type: ignore[arg-type]


async def test_start_in_one_task_and_aclose_in_another(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint(MODEL)
    box: list[AsyncEngine] = []

    async def cell_1() -> None:
        box.append(await AsyncEngine.start(_config(path)))

    with anyio.fail_after(120):
        await _in_own_task(cell_1)
        engine = box[0]
        out = await engine.generate([5, 6, 7], GREEDY)
        assert len(out.outputs[0].token_ids) == 4
        pending = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
        await _in_own_task(engine.aclose)
        assert (await pending).outputs[0].finish_reason == "abort"
        assert_no_leaks(engine)
        await engine.aclose()  # closing again: nothing to do
    with pytest.raises(EngineClosedError, match="closed"):
        engine.generate([5], GREEDY)


async def test_async_with_entered_and_exited_in_different_tasks(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    engine = AsyncEngine(_config(tiny_checkpoint(MODEL)))
    with anyio.fail_after(120):
        await _in_own_task(engine.__aenter__)

        async def exit_cell() -> None:
            await engine.__aexit__(None, None, None)

        await _in_own_task(exit_cell)
    assert_no_leaks(engine)


async def test_calls_after_close_are_clear(tiny_checkpoint: Callable[[str], Path]) -> None:
    with anyio.fail_after(120):
        async with AsyncEngine(_config(tiny_checkpoint(MODEL))) as engine:
            stream = engine.generate([5, 6, 7], GREEDY)
            await stream
        await engine.abort("anything")  # every request has finished: a no-op
        await stream.aclose()
        with pytest.raises(EngineClosedError, match="not running"):
            engine.generate([5], GREEDY)
        with pytest.raises(EngineClosedError, match="not running"):
            await engine.wait_idle()


async def test_a_second_start_is_refused_before_loading_anything(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    resolve = engine_module.resolve_model_path

    def counting_resolve(model: str, revision: str | None) -> Path:
        loads.append(model)
        return resolve(model, revision)

    monkeypatch.setattr(engine_module, "resolve_model_path", counting_resolve)
    with anyio.fail_after(120):
        engine = await AsyncEngine.start(_config(tiny_checkpoint(MODEL)))
        with pytest.raises(EngineClosedError, match="starts only once"):
            await engine.__aenter__()  # while running
        await engine.aclose()
        for _ in range(2):
            with pytest.raises(EngineClosedError, match="starts only once"):
                async with engine:
                    pass
    assert len(loads) == 1


async def test_aclose_of_a_failed_engine_raises_engine_dead(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    with anyio.fail_after(120):
        engine = await AsyncEngine.start(_config(tiny_checkpoint(MODEL)))

        class BrokenRunner:
            def execute(self, plan: object) -> None:
                raise RuntimeError("injected step failure")

        engine._executor.runner = BrokenRunner()  # type: ignore[assignment]
        with pytest.raises(EngineDeadError):
            await engine.generate([5, 6, 7], GREEDY)
        with pytest.raises(EngineDeadError) as info:
            await engine.aclose()
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_closed_engines_do_not_pile_up(tiny_checkpoint: Callable[[str], Path]) -> None:
    """Memory must not grow with every enter/exit cycle. A closed engine left as garbage only in
    reference cycles (its intake actor holding its bound methods; its stopped tasks' frames, held
    by their tracebacks) would wait for a full collection, model and KV cache included, and 5
    cycles would leave 5 engines alive. The last reference to a closed engine frees it."""
    config = _config(tiny_checkpoint(MODEL))
    if hasattr(config, "gc_freeze"):  # its gc.collect() at each start would hide a pile-up
        config = dataclasses.replace(config, gc_freeze=False)
    refs: list[weakref.ref[AsyncEngine]] = []
    with anyio.fail_after(300):
        for _ in range(5):
            async with AsyncEngine(config) as engine:
                await engine.generate([5, 6, 7], GREEDY)
            refs.append(weakref.ref(engine))
            del engine
            await anyio.sleep(0.01)
    assert sum(r() is not None for r in refs) == 0
    gc.collect()
    assert all(r() is None for r in refs), "a closed engine is kept alive"


def test_the_failure_cause_drops_the_broken_channels_it_caused() -> None:
    """An actor's error, with or without the broken or closed channels of the actors whose
    peer it took down (they race it into the task group), is the engine's cause; a group of
    several real errors stays a group, and one of consequences alone is kept as it came."""
    from asyncpaged.engine.lifecycle import failure_cause

    root = RuntimeError("injected")
    broken = ExceptionGroup("inner", [anyio.BrokenResourceError(), anyio.BrokenResourceError()])
    assert failure_cause(ExceptionGroup("g", [root])) is root
    assert failure_cause(ExceptionGroup("g", [root, broken])) is root
    assert failure_cause(ExceptionGroup("g", [anyio.ClosedResourceError(), root])) is root
    two = ExceptionGroup("g", [root, ValueError("also")])
    assert failure_cause(two) is two
    only = failure_cause(ExceptionGroup("g", [broken]))
    assert isinstance(only, ExceptionGroup) and len(only.exceptions) == 2
    assert failure_cause(root) is root
