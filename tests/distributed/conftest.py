"""Tensor-parallel test fixtures: tiny checkpoints, the transformers oracle, engine runs."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import AsyncEngine, EngineConfig, RequestOutput, SamplingParams
from asyncpaged.config import KVShape
from asyncpaged.distributed import TensorParallelRunner
from asyncpaged.model.loader import load_config
from tests.engine.conftest import assert_no_leaks, perturbed_draft
from tests.model.conftest import hf_reference, tiny_checkpoint

__all__ = [
    "EngineRun", "hf_reference", "make_prompts", "perturbed_draft", "run_engine", "tiny_checkpoint",
]  # fmt: skip


@pytest.fixture(autouse=True, scope="package")
def _single_thread() -> Iterator[None]:
    # Tiny matmuls: threads only add overhead. Each rank gets rank 0's thread count.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_prompts(n: int, seed: int) -> list[tuple[int, ...]]:
    """Mixed lengths around block boundaries (block size 16) and longer than one prefill chunk."""
    rng = random.Random(seed)
    fixed = [15, 16, 17, 1, 32, 33, 40, 5]
    lengths = [fixed[i] if i < len(fixed) else rng.randint(1, 40) for i in range(n)]
    return [tuple(rng.randrange(4, 320) for _ in range(length)) for length in lengths]


def host_bytes(model: Path, num_blocks: int, tensor_parallel_size: int) -> int:
    """``swap_space_bytes`` (a per-rank budget) that gives ``num_blocks`` host blocks."""
    shape = KVShape.from_hf_config(load_config(model), 4, tensor_parallel_size)
    return num_blocks * shape.block_bytes(16)


@dataclass
class EngineRun:
    """What a test reads back from one engine's run."""

    outputs: list[RequestOutput]
    num_swap_outs: int
    num_recomputes: int
    num_mixed_steps: int  # steps with a prefill (chunk) and a decode together
    kv_cache_bytes: list[int]  # per rank
    num_kv_heads: list[int]  # per rank
    worker_exitcodes: list[int | None]  # after the engine's exit
    worker_pids: list[int]
    # (free, total) device blocks the moment the last request returned (before wait_idle)
    blocks_at_return: tuple[int, int] = (0, 0)
    num_draft_tokens: int = 0  # speculative decoding's proposals
    num_accepted_tokens: int = 0
    num_steps_planned_ahead: int = 0  # async scheduling


async def _generate_all(
    engine: AsyncEngine, prompts: list[tuple[int, ...]], params: SamplingParams
) -> list[RequestOutput]:
    results: list[RequestOutput | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await engine.generate(list(prompts[i]), params)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


def run_engine(
    model: Path,
    prompts: list[tuple[int, ...]],
    max_tokens: int,
    params: SamplingParams | None = None,
    **config: Any,
) -> EngineRun:
    """Run ``prompts`` to completion on a fresh engine (leak-checked) and report: greedily
    unless ``params`` are given."""
    if params is None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def main() -> EngineRun:
        mixed = 0
        cfg = EngineConfig(model=str(model), dtype="float32", **config)
        async with AsyncEngine(cfg) as engine:
            step_runner = engine._executor.runner
            execute = step_runner.execute

            def spy(plan: Any) -> Any:  # counts steps that mix a prefill and a decode
                nonlocal mixed
                lens = {len(s.token_ids) == 1 for s in plan.seqs}
                mixed += lens == {True, False}
                return execute(plan)

            step_runner.execute = spy  # type: ignore[method-assign]
            with anyio.fail_after(120):
                outputs = await _generate_all(engine, prompts, params)
                at_return = engine.statistics()
                await engine.wait_idle()
            assert_no_leaks(engine)
            stats = engine.statistics()
            tp = engine._workers
            assert tp is None or isinstance(tp, TensorParallelRunner)
            if tp is None:
                kv_bytes = [engine.runner.kv_cache.num_bytes]
                heads = [engine.runner.model.num_kv_heads]
            else:
                kv_bytes = [r.kv_cache_bytes for r in tp.ready]
                heads = [r.num_kv_heads for r in tp.ready]
                assert kv_bytes[0] == engine.runner.kv_cache.num_bytes
        workers = [] if tp is None else tp._workers
        return EngineRun(
            outputs=outputs,
            num_swap_outs=stats.num_swap_outs,
            num_recomputes=stats.num_recomputes,
            num_mixed_steps=mixed,
            kv_cache_bytes=kv_bytes,
            num_kv_heads=heads,
            worker_exitcodes=[p.exitcode for p in workers],
            worker_pids=[p.pid for p in workers if p.pid is not None],
            blocks_at_return=(at_return.num_free_device_blocks, at_return.num_device_blocks),
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            num_steps_planned_ahead=stats.num_steps_planned_ahead,
        )

    return anyio.run(main)
