"""A tensor-parallel worker that dies fails the engine: every waiter gets EngineDeadError at
once (the cause names the worker), nothing hangs, and every process is reaped."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from asyncpaged.distributed import TensorParallelRunner
from asyncpaged.errors import WorkerDiedError
from tests.distributed.conftest import make_prompts

MODEL = "llama-gqa"
DEADLINE_S = 5.0  # a waiter learns of the death within this


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2,
                        num_device_blocks=128, max_num_batched_tokens=64)  # fmt: skip


def _assert_reaped(pid: int) -> None:
    assert not Path(f"/proc/{pid}").exists(), f"worker {pid} was not reaped (zombie or alive)"
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("when", ["mid_run", "idle"])
def test_killed_worker_fails_every_waiter(
    when: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    prompts = make_prompts(8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    delays: list[float] = []
    errors: list[BaseException] = []
    pids: list[int] = []

    async def wait_for(engine: AsyncEngine, prompt: tuple[int, ...], killed: list[float]) -> None:
        with pytest.raises(EngineDeadError) as info:
            await engine.generate(list(prompt), params)
        delays.append(time.monotonic() - killed[0])
        errors.append(info.value)

    async def wait_idle(engine: AsyncEngine, killed: list[float]) -> None:
        await anyio.sleep(0.05)  # the requests are in
        with pytest.raises(EngineDeadError):
            await engine.wait_idle()
        delays.append(time.monotonic() - killed[0])

    async def main() -> None:
        with anyio.fail_after(60):  # no hang, whatever happens
            await run()

    async def run() -> None:
        killed: list[float] = []
        async with AsyncEngine(_config(tiny_checkpoint(MODEL))) as engine:
            assert isinstance(engine._workers, TensorParallelRunner)
            pids.extend(engine._workers.worker_pids)
            if when == "idle":  # nothing in flight: only the watchdog can notice
                os.kill(pids[0], signal.SIGKILL)
                killed.append(time.monotonic())
                with anyio.fail_after(DEADLINE_S):
                    while engine._dead is None:
                        await anyio.sleep(0.01)
                delays.append(time.monotonic() - killed[0])
                with pytest.raises(EngineDeadError):
                    engine.generate([5, 6, 7], params)
                return
            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(wait_for, engine, prompt, killed)
                tg.start_soon(wait_idle, engine, killed)
                while engine.statistics().num_steps < 8:  # decoding, mid-run
                    await anyio.sleep(0.005)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(time.monotonic())

    with pytest.raises(EngineDeadError) as exit_info:
        anyio.run(main)
    assert isinstance(exit_info.value.__cause__, WorkerDiedError)
    assert f"pid {pids[0]}" in str(exit_info.value.__cause__)
    if when == "mid_run":
        assert len(errors) == len(prompts)
        assert all(isinstance(e.__cause__, WorkerDiedError) for e in errors), errors
    assert max(delays) < DEADLINE_S, delays
    _assert_reaped(pids[0])
