"""Async scheduling with speculative decoding, end to end.

A step goes ahead of the one in flight only where no sequence that one samples proposes next
(its proposals follow the token in flight) and none verifies proposals in it (where its next
row starts depends on how many it keeps); so steps go ahead while sequences back off, above
``disable_by_batch_size``, and, with async scheduling, after a proposer found nothing (a miss
backs off too, aligned to the plan count). Tokens must equal the sync engine's (greedy:
transformers'), with the runner on its thread and in its process, under swap and recompute
preemption; a draft model's cache must take the placeholders (as the target's own draft every
greedy proposal made after steps that went ahead is accepted). Seeded sampling planned ahead
is tested beside the sync case in test_speculative.py. Every engine is leak-checked on exit
(``running_engine``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import SamplingParams, SpeculativeConfig
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.engine.test_speculative import (
    NGRAM,
    MissingOracle,
    Oracle,
    _with_oracle,
    greedy_under_pressure,
)
from tests.engine.test_speculative_draft import _spec
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio
BACKENDS = ["thread", "process"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_greedy_speculation_planned_ahead_matches_transformers(
    backend: str,
    mode: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stats = await greedy_under_pressure(
        tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa"), mode, MissingOracle,
        monkeypatch, async_scheduling=True, executor_backend=backend,
    )  # fmt: skip
    assert stats.num_steps_planned_ahead > 0, stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


async def test_prompt_lookup_goes_ahead_while_it_finds_nothing(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """The real proposer, on prompts that repeat a span (it finds matches at first) and on
    prompts that do not (its misses back off, so most steps go ahead)."""
    path, ref = tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa")
    rng = random.Random(5)
    prompts = []
    for i in range(8):
        span = [rng.randrange(4, 320) for _ in range(rng.randint(3, 9))]
        prompts.append(tuple(span * (rng.randint(2, 4) if i % 2 else 1)))
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with anyio.fail_after(120):
        async with running_engine(path, speculative_config=NGRAM, async_scheduling=True,
                                  executor_backend="process") as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, greedy)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 32)[0], prompt
    assert stats.num_draft_tokens > 0, stats
    assert stats.num_steps_planned_ahead > stats.num_steps // 2, stats


@pytest.mark.parametrize("penalized", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_above_the_batch_limit_every_step_may_go_ahead(
    backend: str,
    penalized: bool,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """With the target as its own draft every greedy proposal is accepted, if the draft's
    cache holds what the target's does: above ``disable_by_batch_size`` nothing is proposed
    and steps go ahead (placeholders through the draft's forward too); as requests finish the
    batch falls under the limit and the proposals made over those caches are all kept.
    Penalized too: the options of a row planned ahead come late, and the draft draws the
    proposals after it with them (with the planned ones, plain greedy, it proposed tokens the
    penalties then rejected)."""
    path, ref = tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa")
    prompts = make_prompts(8, seed=12)
    lengths = [8 + 3 * i for i in range(len(prompts))]  # they finish one by one
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=str(path),
                             disable_by_batch_size=3)  # fmt: skip

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True,
                              repetition_penalty=1.3 if penalized else 1.0)  # fmt: skip

    with anyio.fail_after(240):
        if penalized:
            async with running_engine(path, async_scheduling=False) as engine:
                expected = [o.outputs[0].token_ids for o in await generate_all(engine, prompts,
                                                                               params)]  # fmt: skip
        else:
            expected = [ref.generate(p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
        async with running_engine(path, speculative_config=spec, async_scheduling=True,
                                  executor_backend=backend) as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, params)
            stats = engine.statistics()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.num_steps_planned_ahead > 5, stats
    assert stats.num_draft_tokens > 0, stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_perturbed_draft_planned_ahead_equals_the_sync_engine(
    backend: str,
    tiny_checkpoint: Callable[[str], Path],
    perturbed_draft: Callable[[str], Path],
) -> None:
    """A draft that is often rejected (so sequences back off and steps go ahead): greedy
    requests, plain and penalized (with the whole histories a draft-model engine sends, which
    take the placeholders), get the sync engine's tokens. (A sampled row verified against the
    draft's distribution is exact in distribution, not token for token: its tokens depend on
    what was proposed, which async scheduling changes.)"""
    path = tiny_checkpoint("llama-gqa")
    prompts = make_prompts(10, seed=8)
    kinds = [{}, {"repetition_penalty": 1.3},
             {"presence_penalty": 0.8, "frequency_penalty": 0.5, "min_tokens": 12}]  # fmt: skip

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=20, **kinds[i % 3])

    common = {"num_device_blocks": 14, "preemption_mode": "recompute", "executor_backend": backend}
    with anyio.fail_after(240):
        async with running_engine(path, async_scheduling=False, **common) as engine:
            plain = await generate_all(engine, prompts, params)
        async with running_engine(path, speculative_config=_spec(perturbed_draft("llama-gqa")),
                                  async_scheduling=True, **common) as engine:  # fmt: skip
            spec = await generate_all(engine, prompts, params)
            stats = engine.statistics()
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], i
    assert stats.num_steps_planned_ahead > 0, stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_a_prompt_ending_in_a_one_token_chunk_fans_out_without_proposals(
    async_scheduling: bool, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill leaves the last prompt token of an n = 2 request for a step of its
    own: that row draws both first tokens and takes no proposals (before, it took them, the
    verification dropped the fork and the request never finished); the decodes after it
    do."""
    path = tiny_checkpoint("llama-gqa")
    prompt = make_prompts(1, seed=4)[0]
    prompt = (prompt * 40)[:33]
    params = SamplingParams(temperature=1.0, n=2, seed=1, max_tokens=12)
    common = {"max_num_batched_tokens": 32, "max_model_len": 256,
              "async_scheduling": async_scheduling}  # fmt: skip
    with anyio.fail_after(60):
        async with running_engine(path, **common) as engine:
            [plain] = await generate_all(engine, [prompt], params)
        oracle = Oracle({prompt: [list(c.token_ids) for c in plain.outputs]}, seed=6)
        _with_oracle(monkeypatch, oracle)
        async with running_engine(path, speculative_config=NGRAM, **common) as engine:
            [spec] = await generate_all(engine, [prompt], params)
            stats = engine.statistics()
    assert [c.token_ids for c in spec.outputs] == [c.token_ids for c in plain.outputs]
    assert stats.num_draft_tokens > 0, stats
