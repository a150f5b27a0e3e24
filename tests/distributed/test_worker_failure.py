"""A tensor-parallel worker that dies fails the engine: every waiter gets EngineDeadError at
once (the cause names the worker), nothing hangs, and every process is reaped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from asyncpaged.distributed import TensorParallelRunner
from tests.distributed.conftest import make_prompts
from tests.worker_death import Death, assert_died_well, kill_worker

MODEL = "llama-gqa"


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2,
                        num_device_blocks=128, max_num_batched_tokens=64)  # fmt: skip


@pytest.mark.parametrize("when", ["mid_run", "idle"])
def test_killed_worker_fails_every_waiter(
    when: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    prompts = make_prompts(8, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    pids: list[int] = []
    deaths: list[Death] = []

    async def main() -> None:
        with anyio.fail_after(60):  # no hang, whatever happens
            async with AsyncEngine(_config(tiny_checkpoint(MODEL))) as engine:
                assert isinstance(engine._workers, TensorParallelRunner)
                pids.extend(engine._workers.worker_pids)
                deaths.append(await kill_worker(engine, pids[0], when, prompts, params,
                                                wait_idle=True))  # fmt: skip

    with pytest.raises(EngineDeadError) as exit_info:
        anyio.run(main)
    assert_died_well(exit_info.value, pids[0], when, deaths[0], len(prompts))
