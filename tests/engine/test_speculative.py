"""Speculative decoding end to end: exact against transformers and against itself unspeculated.

The tiny random models seldom repeat themselves, so prompt lookup alone would rarely be tested
past a rejection. Most tests therefore swap the engine's proposer (``AsyncEngine._proposer``,
the one seam) for an *oracle*: it proposes the reference continuation of the sequence (the
unspeculated engine's output, or transformers') with one token corrupted at a random position
of a random number of proposals, so every step accepts 0..k of them and rolls the rest back.
One test runs the real prompt-lookup proposer. Every engine is leak-checked on exit
(``running_engine``): all blocks free, nothing left.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineStatistics, SamplingParams, SpeculativeConfig
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                          prompt_lookup_max=3)  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Oracle:
    """Proposes the known continuation of a context, corrupted at a random position."""

    def __init__(self, continuations: dict[tuple[int, ...], list[list[int]]], seed: int) -> None:
        self._known = continuations  # prompt -> the expected outputs (one per completion)
        self._rng = random.Random(seed)
        self.num_calls = 0

    def __call__(self, seq_id: int, token_ids: list[int], k: int) -> Sequence[int]:
        self.num_calls += 1
        for prompt, outputs in self._known.items():
            if tuple(token_ids[: len(prompt)]) != prompt:
                continue
            done = token_ids[len(prompt) :]
            for out in outputs:
                if out[: len(done)] == done:
                    draft = list(out[len(done) : len(done) + self._rng.randint(0, k)])
                    if draft and self._rng.random() < 0.6:  # a wrong token at a random place
                        j = self._rng.randrange(len(draft))
                        draft[j] = 4 + (draft[j] + 1 + self._rng.randrange(50)) % 300
                    return draft
        return []


class MissingOracle(Oracle):
    """The oracle, but finding nothing half the time, as prompt lookup often does."""

    def __call__(self, seq_id: int, token_ids: list[int], k: int) -> Sequence[int]:
        draft = super().__call__(seq_id, token_ids, k)
        return draft if self._rng.random() < 0.5 else []


def _with_oracle(monkeypatch: pytest.MonkeyPatch, oracle: Oracle | None) -> None:
    if oracle is not None:
        monkeypatch.setattr(AsyncEngine, "_proposer", lambda self: oracle)


async def greedy_under_pressure(
    path: Path,
    ref: HFReference,
    mode: str,
    oracle: Callable[[dict[tuple[int, ...], list[list[int]]], int], Oracle],
    monkeypatch: pytest.MonkeyPatch,
    **config: Any,
) -> EngineStatistics:
    """16 greedy prompts in 12 blocks (``mode`` preemption, which must happen) with prompt
    lookup replaced by ``oracle`` over transformers' outputs: every output must be
    transformers'. Returns the engine's statistics."""
    prompts = make_prompts(16, seed=7)
    expected = {p: [ref.generate(p, 20)[0]] for p in prompts}
    _with_oracle(monkeypatch, oracle(expected, 1))
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=12, preemption_mode=mode,
                                  speculative_config=NGRAM, **config) as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, greedy)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == expected[prompt][0], prompt
    assert stats.num_preemptions > 0
    return stats


@pytest.mark.parametrize("model", ["llama-gqa", "opt", "gpt2"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_greedy_speculation_matches_transformers_under_memory_pressure(
    model: str,
    mode: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stats = await greedy_under_pressure(
        tiny_checkpoint(model), hf_reference(model), mode, Oracle, monkeypatch
    )
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    # every position was reached and rejected sometimes
    assert len(stats.spec_acceptance_by_position) == NGRAM.num_speculative_tokens
    assert all(0 < r < 1 for r in stats.spec_acceptance_by_position[:2]), stats


async def test_prompt_lookup_is_exact_and_proposes(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """The real n-gram proposer on prompts that repeat themselves (it finds matches)."""
    path, ref = tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa")
    rng = random.Random(5)
    prompts = []
    for _ in range(6):
        span = [rng.randrange(4, 320) for _ in range(rng.randint(3, 9))]
        prompts.append(tuple(span * rng.randint(2, 5)))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with anyio.fail_after(120):
        async with running_engine(path, speculative_config=NGRAM) as engine:
            outs = await generate_all(engine, prompts, greedy)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 24)[0], prompt
    assert stats.num_draft_tokens > 0


def _sampled(i: int) -> SamplingParams:
    """Sampling settings that cycle through temperature, top-k/p, min-p, penalties, min_tokens
    with EOS, n = 2 and a short max_tokens; every request seeded."""
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.8},
        {"temperature": 1.0, "top_k": 20, "top_p": 0.9},
        {"temperature": 0.7, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"temperature": 0.9, "repetition_penalty": 1.3, "min_tokens": 6},
        {"temperature": 1.0, "n": 2},
        {"temperature": 0.6, "max_tokens": 3},
    ]
    kind = {"max_tokens": 16, **kinds[i % len(kinds)]}
    return SamplingParams(seed=100 + i, **kind)


@pytest.mark.parametrize(
    ("prefix_caching", "loop"),
    [(False, "sync"), (True, "sync"), (False, "thread"), (True, "process")],
)
async def test_seeded_sampling_is_token_identical_with_and_without_speculation(
    prefix_caching: bool,
    loop: str,
    tiny_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Verification draws the target's own token at every position from the same seeded
    stream, so a seeded request's output does not depend on what was proposed. With async
    scheduling (``loop``: the runner's thread or process) too, the proposer finding nothing
    half the time, so steps go ahead between proposals (penalty histories take placeholders):
    the sync engine's tokens without speculation."""
    path = tiny_checkpoint("llama-gqa")
    prompts = make_prompts(12, seed=9)
    common = {"num_device_blocks": 16, "preemption_mode": "swap",
              "enable_prefix_caching": prefix_caching}  # fmt: skip
    ahead = {} if loop == "sync" else {"async_scheduling": True, "executor_backend": loop}
    with anyio.fail_after(180):
        async with running_engine(path, async_scheduling=False, **common) as engine:
            plain = await generate_all(engine, prompts, _sampled)
        known = {
            p: [list(c.token_ids) for c in o.outputs] for p, o in zip(prompts, plain, strict=True)
        }
        _with_oracle(monkeypatch, (Oracle if loop == "sync" else MissingOracle)(known, seed=2))
        async with running_engine(path, speculative_config=NGRAM, **common, **ahead) as engine:
            spec = await generate_all(engine, prompts, _sampled)
            if prefix_caching:  # again, now over blocks registered after verification
                again = await generate_all(engine, prompts, _sampled)
            stats = engine.statistics()
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], i
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs], i
        assert all(len(c.token_ids) <= _sampled(i).max_tokens for c in b.outputs), i
    if prefix_caching:
        assert [[c.token_ids for c in o.outputs] for o in again] == [
            [c.token_ids for c in o.outputs] for o in spec
        ]
    assert stats.num_accepted_tokens > 0, stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens, stats
    assert (stats.num_steps_planned_ahead > 0) == (loop != "sync"), stats


async def test_stop_strings_and_aborts_under_speculation(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop string inside accepted proposals cuts the output where the unspeculated run does;
    requests cancelled midway free everything (the leak check on exit)."""
    path = tiny_checkpoint("llama-gqa")
    prompts = make_prompts(10, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with anyio.fail_after(180):
        async with running_engine(path) as engine:
            plain = await generate_all(engine, prompts, greedy)
        texts = [o.outputs[0].text for o in plain]
        stops = [t[len(t) // 2 : len(t) // 2 + 2] for t in texts]

        def with_stop(i: int) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                  stop=[stops[i]] if stops[i].strip() else None)  # fmt: skip

        async with running_engine(path) as engine:
            expected = await generate_all(engine, prompts, with_stop)
        known = {p: [list(o.outputs[0].token_ids)] for p, o in zip(prompts, plain, strict=True)}
        _with_oracle(monkeypatch, Oracle(known, seed=3))
        async with running_engine(path, num_device_blocks=10,
                                  speculative_config=NGRAM) as engine:  # fmt: skip
            got = await generate_all(engine, prompts, with_stop)
            async with anyio.create_task_group() as tg:  # cancelled after a few steps
                for i in range(len(prompts)):
                    tg.start_soon(_cancel_soon, engine, prompts[i], greedy)
    for a, b in zip(expected, got, strict=True):
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].stop_reason == b.outputs[0].stop_reason


async def _cancel_soon(
    engine: AsyncEngine, prompt: tuple[int, ...], params: SamplingParams
) -> None:
    with anyio.move_on_after(0.05):
        await engine.generate(list(prompt), params)
