"""A sampled completion whose sampling options can no longer change (no penalties, bad words,
grammar or logits processors, past its min-tokens mask) uses the very same options object in
every later step instead of building it again (``actors.step_builder``), sent once: later rows
keep it in the runner (``worker/input_batch``). A row under its min-tokens mask gets the mask, built
per step, until it ends. A seeded row's options are fixed too: the runner derives each draw's
generator key from the row's position, the key the scheduler used to send."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import SamplingParams
from asyncpaged.sampling.options import SamplingOptions, derive_generator_key
from asyncpaged.worker.input_batch import InputBatch
from asyncpaged.worker.protocol import with_generator_keys
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.engine.test_persistent_tables import Recorder

MODEL = "llama-gqa"
NEW_TOKENS = 12
MIN_TOKENS = 4

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_fixed_options_are_sent_once_built_and_the_others_per_step(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    prompts = make_prompts(3, seed=4)
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=NEW_TOKENS, ignore_eos=True,
                       min_tokens=MIN_TOKENS, stop_token_ids=[3]),
        SamplingParams(temperature=0.9, max_tokens=NEW_TOKENS, ignore_eos=True, seed=5),
        SamplingParams(temperature=0.9, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
    ]  # fmt: skip
    with anyio.fail_after(120):
        async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=64) as engine:
            recorder = Recorder(engine._executor.runner)
            engine._executor.runner = recorder
            outs = await generate_all(engine, prompts, lambda i: params[i])
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    by_prompt: dict[int, list[SamplingOptions]] = {}
    kept_rows: dict[int, int] = {}  # prompt -> rows sent without their options
    keys: list[int] = []  # the seeded row's generator keys, as the runner derives them
    prompt_of: dict[int, int] = {}  # seq id -> prompt, from its first (prefill) row
    kept = InputBatch()  # the runner's side, replayed
    for plan in recorder.plans:
        seqs = kept.update(plan.seqs).seqs
        resolved = with_generator_keys(dataclasses.replace(plan, seqs=seqs))
        for s, row in zip(plan.seqs, resolved.seqs, strict=True):
            if s.seq_id not in prompt_of:
                assert s.num_computed_tokens == 0
                prompt_of[s.seq_id] = prompts.index(tuple(s.token_ids))
            i = prompt_of[s.seq_id]
            if s.keep_sampling:
                assert s.sampling is None
                kept_rows[i] = kept_rows.get(i, 0) + 1
            if s.do_sample:
                assert row.sampling is not None and not row.keep_sampling
                by_prompt.setdefault(i, []).append(kept.options_of(s.seq_id))
                if i == 1:
                    keys.append(row.sampling.generator_key)
    assert [len(by_prompt[i]) for i in range(3)] == [NEW_TOKENS] * 3
    masked, fixed = by_prompt[0][:MIN_TOKENS], by_prompt[0][MIN_TOKENS:]
    assert all(o.min_tokens_mask_ids == (3,) for o in masked)
    assert len({id(o) for o in masked}) == MIN_TOKENS  # built per step while masked
    assert all(o is fixed[0] for o in fixed) and fixed[0].min_tokens_mask_ids == ()
    assert (fixed[0].temperature, fixed[0].top_p) == (0.9, 0.8)
    seeded = by_prompt[1]  # one object, its generator key derived from each row's position
    assert all(o is seeded[0] for o in seeded)
    assert seeded[0].key_from_position == (0, len(prompts[1]))
    assert keys == [derive_generator_key(5, 0, k) for k in range(NEW_TOKENS)]
    assert all(o is by_prompt[2][0] for o in by_prompt[2])
    assert by_prompt[2][0].num_logprobs == 2
    # Each fixed object is sent once: every later row keeps it in the runner
    assert kept_rows == {0: NEW_TOKENS - MIN_TOKENS - 1, 1: NEW_TOKENS - 1, 2: NEW_TOKENS - 1}
