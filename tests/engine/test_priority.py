"""Priority scheduling end to end on a tiny checkpoint: a high-priority request submitted while
a low-priority one runs finishes first, and every request's greedy tokens equal transformers'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpaged import InvalidRequestError, SamplingParams
from tests.engine.conftest import running_engine
from tests.model.reference import HFReference

MODEL = "llama-gqa"
LOW = tuple(range(3, 103))  # 100 tokens: 7 of 8 blocks
HIGH = tuple(range(100, 130))  # 30 tokens

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def race(engine: Any, low_tokens: int, high_tokens: int) -> tuple[list[str], dict[str, Any]]:
    """Start the low-priority request, and once it streams submit the high-priority one."""
    order: list[str] = []
    outs: dict[str, Any] = {}
    started = anyio.Event()

    async def low() -> None:
        params = SamplingParams(max_tokens=low_tokens, temperature=0.0, ignore_eos=True)
        async for out in engine.generate(list(LOW), params, priority=5):
            started.set()
            outs["low"] = out
        order.append("low")

    async def high() -> None:
        await started.wait()
        params = SamplingParams(max_tokens=high_tokens, temperature=0.0, ignore_eos=True)
        outs["high"] = await engine.generate(list(HIGH), params, priority=-1)
        order.append("high")

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(low)
            tg.start_soon(high)
    return order, outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("shortage", ["max_num_seqs", "kv_blocks"])
async def test_high_priority_finishes_first_with_unchanged_tokens(
    mode: str,
    shortage: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    # kv_blocks: 8 blocks of 16 hold the low request's 100 + 24 tokens and nothing else.
    limits = {"max_num_seqs": 1} if shortage == "max_num_seqs" else {"num_device_blocks": 8}
    async with running_engine(path, scheduling_policy="priority", preemption_mode=mode,
                              watermark=0.0, **limits) as engine:  # fmt: skip
        order, outs = await race(engine, low_tokens=24, high_tokens=6)
        stats = engine.statistics()
    assert order == ["high", "low"]
    assert stats.num_preemptions >= 1
    assert outs["low"].outputs[0].token_ids == ref.generate(LOW, 24)[0]
    assert outs["high"].outputs[0].token_ids == ref.generate(HIGH, 6)[0]


async def test_fcfs_lets_the_running_request_finish(tiny_checkpoint: Callable[[str], Path]) -> None:
    async with running_engine(tiny_checkpoint(MODEL), max_num_seqs=1) as engine:
        with pytest.raises(InvalidRequestError, match="not enabled"):
            engine.generate([1, 2, 3], priority=1)
        order: list[str] = []
        started = anyio.Event()

        async def low() -> None:
            params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate(list(LOW), params):
                started.set()
            order.append("low")

        async def high() -> None:
            await started.wait()
            await engine.generate(list(HIGH), SamplingParams(max_tokens=3, temperature=0.0))
            order.append("high")

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(low)
                tg.start_soon(high)
    assert order == ["low", "high"]


@pytest.mark.parametrize("bad", [True, False, 1.0, "0", None])
async def test_priority_must_be_an_int(bad: Any, tiny_checkpoint: Callable[[str], Path]) -> None:
    async with running_engine(tiny_checkpoint(MODEL), scheduling_policy="priority") as engine:
        with pytest.raises(InvalidRequestError, match="priority must be an int"):
            engine.generate([1, 2, 3], priority=bad)
        out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2), priority=-(10**12))
        assert len(out.outputs[0].token_ids) == 2
