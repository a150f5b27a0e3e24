"""Each step sends only the block-table entries that changed (the runner's persistent input
batch, ``worker/input_batch.py``): the runner keeps the tables, and the tokens stay
transformers'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import SamplingParams
from asyncpaged.worker.protocol import StepPlan, StepResult, StepRunner
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.model.reference import HFReference

MODEL = "llama-gqa"
NEW_TOKENS = 40

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Recorder:
    """The executor's runner, recording every plan it runs."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        return self.runner.execute(plan)

    def __getattr__(self, name: str) -> object:
        return getattr(self.runner, name)


async def test_steps_send_only_new_blocks_and_tokens_match(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with anyio.fail_after(120):
        async with running_engine(path, num_device_blocks=64) as engine:
            recorder = Recorder(engine._executor.runner)
            engine._executor.runner = recorder
            outs = await generate_all(engine, prompts, params)
            assert engine.statistics().num_preemptions == 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, NEW_TOKENS)[0], prompt
    sent: dict[int, int] = {}  # block ids sent per sequence, over all steps
    last: dict[int, int] = {}  # the table length the runner holds after the last step
    final: dict[int, int] = {}  # each sequence's table length at its last step
    for plan in recorder.plans:
        now = {}
        for s in plan.seqs:
            assert s.table_start == last.get(s.seq_id, 0), "a table resent or skipped"
            sent[s.seq_id] = sent.get(s.seq_id, 0) + len(s.block_table)
            now[s.seq_id] = s.table_start + len(s.block_table)
            context = s.num_computed_tokens + len(s.token_ids)
            assert now[s.seq_id] == -(-context // 16), "the table covers exactly the context"
        last = now
        final.update(now)
    decode_steps = [p for p in recorder.plans if all(len(s.token_ids) == 1 for s in p.seqs)]
    assert len(decode_steps) >= NEW_TOKENS - 2
    # Most decode rows carry no block id at all: a table grows once per 16 tokens.
    rows = [s for p in decode_steps for s in p.seqs]
    assert sum(1 for s in rows if s.block_table) <= len(rows) // 8
    assert len(sent) == len(prompts)
    assert sent == final, "each block id was sent once"
    expected = sorted(-(-(len(p) + NEW_TOKENS - 1) // 16) for p in prompts)
    assert sorted(final.values()) == expected
