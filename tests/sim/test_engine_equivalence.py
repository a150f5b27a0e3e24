"""The simulator and the engine make the same scheduling decisions on the same trace.

The engine runs a tiny real model with a small KV budget; we record, at its scheduler core, when
each request was added (how many steps had been planned) and, per step, the sequences admitted
from the waiting queue, the requests preempted and the sequences computed. The simulator gets
the same requests at the same step boundaries and must decide the same, step by step. Requests
ignore EOS, so both stop at ``max_tokens`` whatever the model samples.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpaged import SamplingParams
from asyncpaged.kv.txn import StepTxn, TxnResult
from asyncpaged.sched.scheduler import SchedulerOutput
from asyncpaged.sim.simulator import SimConfig, SimEngine
from asyncpaged.sim.workload import SimRequest
from tests.engine.conftest import running_engine

pytestmark = pytest.mark.anyio

Decision = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]
ENGINE = {
    "num_device_blocks": 10,
    "block_size": 8,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "swap_space_bytes": 0,
    "watermark": 0.01,
}


ENGINE_SIM = {
    "num_device_blocks": 10,
    "block_size": 8,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 48,
    "watermark": 0.01,
    "max_model_len": 256,
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_trace(seed: int) -> list[tuple[str, list[int], int, int]]:
    """(request id, prompt, max_tokens, n): prompts share a prefix now and then."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, 300) for _ in range(16)]
    trace = []
    for i in range(10):
        prompt = [rng.randrange(4, 300) for _ in range(rng.randint(3, 30))]
        if i % 3 == 0:
            prompt = shared + prompt[:8]
        trace.append((f"q{i}", prompt, rng.randint(4, 24), 2 if i % 4 == 1 else 1))
    return trace


async def test_engine_and_simulator_admit_and_preempt_the_same_sequences(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    trace = make_trace(0)
    added: list[tuple[int, str]] = []  # (steps planned so far, request id)
    decisions: list[Decision] = []
    async with running_engine(tiny_checkpoint("opt"), **ENGINE) as engine:
        core = engine._scheduler.scheduler  # observe the engine's own scheduler core
        add_request, apply = core.add_request, core.apply

        def record_add(request: Any) -> None:
            added.append((len(decisions), request.request_id))
            add_request(request)

        def record_apply(txn: StepTxn, result: TxnResult) -> SchedulerOutput:
            out = apply(txn, result)
            admitted = tuple(g.seq_id for _, grants in result.admitted for g in grants)
            decisions.append((admitted, out.preempted, tuple(s.seq_id for s in out.seqs)))
            return out

        core.add_request, core.apply = record_add, record_apply  # type: ignore[method-assign]
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for rid, prompt, max_tokens, n in trace:
                    params = SamplingParams(
                        max_tokens=max_tokens,
                        n=n,
                        ignore_eos=True,
                        temperature=0.0 if n == 1 else 1.0,
                        seed=1,
                    )

                    async def one(
                        prompt: list[int] = prompt, params: SamplingParams = params, rid: str = rid
                    ) -> None:
                        out = await engine.generate(prompt, params, request_id=rid)
                        assert all(len(c.token_ids) == params.max_tokens for c in out.outputs)

                    tg.start_soon(one)
    preemptions = sum(len(p) for _, p, _ in decisions)
    assert preemptions >= 2, "the trace should exercise preemption"
    assert len({step for step, _ in added}) >= 1

    sim = SimEngine(SimConfig(system="paged", enable_prefix_caching=True, **ENGINE_SIM))
    by_id = {rid: (prompt, max_tokens, n) for rid, prompt, max_tokens, n in trace}
    pending = list(added)
    for step, want in enumerate(decisions):
        while pending and pending[0][0] == step:
            rid = pending.pop(0)[1]
            prompt, max_tokens, n = by_id[rid]
            spec = SimRequest(
                request_id=rid, arrival_s=0.0, prompt_len=len(prompt), output_len=max_tokens, n=n
            )
            sim.add(spec, prompt)
        record = sim.step()
        assert (record.admitted, record.preempted, record.scheduled) == want, f"step {step}"
    assert not pending
    assert not sim.scheduler.has_unfinished
