"""Async scheduling against the engine without it, on random mixes of what a request may ask:
greedy and seeded sampling (top-p, top-k), penalties, stop strings (kept in the output or not)
and stop token ids, bad words, ``min_tokens``, logprobs and prompt logprobs, n = 2 and
best_of, JSON schemas, choices and regexes, logit bias and allowed tokens, special tokens
kept, no detokenizing, short and long outputs, EOS honoured or not. Each mix runs once on the
sync engine with plenty of blocks, then with async scheduling in the runner's process under
memory pressure (swap and recompute) and on the thread: every completion's tokens, text,
finish and stop reason are the same, and its logprobs and prompt logprobs the same within
float noise; a request whose constraints allow no token (a grammar and allowed tokens apart)
fails alike in both. Mixes over prompts that repeat themselves run with prompt-lookup
speculation too."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import anyio
import pytest

from asyncpaged import (
    EngineStatistics,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
    SpeculativeConfig,
    StructuredOutputsParams,
)
from tests.engine.conftest import running_engine
from tests.engine.test_engine import make_prompts
from tests.engine.test_jump_forward import COMPACT

CONSTRAINTS = (
    COMPACT,
    StructuredOutputsParams(choice=["paged", "blocks", "copy on write"]),
    StructuredOutputsParams(regex=r"[a-z]{2,6}( [0-9]{1,3})?"),
)

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"
NUM_REQUESTS = 24


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def mixed_params(rng: random.Random, i: int) -> SamplingParams:
    """One request's parameters, drawn from the menu above (every sampled one seeded)."""
    kw: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 5, 12, 24]), "temperature": 0.0}
    if rng.random() < 0.5:
        kw.update(temperature=0.9, top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]),
                  seed=1000 + i)  # fmt: skip
        if rng.random() < 0.3:
            kw["n"] = 2
    if rng.random() < 0.3:
        kw.update(repetition_penalty=1.2, frequency_penalty=0.1)
    if rng.random() < 0.25:
        kw["stop"] = [rng.choice([" the", "e", "a", " memory"])]
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(4, 320)]
    if rng.random() < 0.2:
        kw["bad_words"] = ["the", "a cat"]
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(1, kw["max_tokens"])
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        kw["prompt_logprobs"] = rng.choice([0, 1])
    if rng.random() < 0.15:
        kw.update(structured_outputs=rng.choice(CONSTRAINTS), max_tokens=48)
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randrange(4, 320): 5.0, rng.randrange(4, 320): -100.0}
    if rng.random() < 0.1:
        kw["allowed_token_ids"] = [*sorted(rng.sample(range(4, 320), 40)), 2]
    if kw.get("n") == 2 and rng.random() < 0.5:
        kw["best_of"] = 3
    if kw.get("stop") and rng.random() < 0.5:
        kw["include_stop_str_in_output"] = True
    if rng.random() < 0.1:
        kw["skip_special_tokens"] = False
    if rng.random() < 0.1:
        kw["detokenize"] = False
        kw.pop("stop", None)  # (stop strings need the text)
    kw["ignore_eos"] = rng.random() < 0.5
    return SamplingParams(**kw)


def _close(a: float, b: float) -> bool:
    return (math.isinf(a) and a == b) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


Outcome: TypeAlias = RequestOutput | RequestFailedError


def assert_same(sync: Outcome, ahead: Outcome, i: int) -> None:
    """The same completions (tokens, text, finish and stop reasons, logprobs within noise)
    and prompt logprobs, or the same failure (constraints that allowed no token)."""
    if isinstance(sync, RequestFailedError) or isinstance(ahead, RequestFailedError):
        assert isinstance(sync, RequestFailedError), (i, ahead)
        assert isinstance(ahead, RequestFailedError), (i, sync)
        assert type(ahead.__cause__) is type(sync.__cause__), i
        return
    assert len(ahead.outputs) == len(sync.outputs), i
    for old, new in zip(sync.outputs, ahead.outputs, strict=True):
        assert (new.token_ids, new.text, new.finish_reason, new.stop_reason) == (
            old.token_ids, old.text, old.finish_reason, old.stop_reason,
        ), i  # fmt: skip
        assert (old.logprobs is None) == (new.logprobs is None), i
        for x, y in zip(old.logprobs or [], new.logprobs or [], strict=True):
            assert x.keys() == y.keys(), i
            assert all(_close(x[t].logprob, y[t].logprob) and x[t].rank == y[t].rank
                       for t in x), i  # fmt: skip
    assert (sync.prompt_logprobs is None) == (ahead.prompt_logprobs is None), i
    for p, q in zip(sync.prompt_logprobs or [], ahead.prompt_logprobs or [], strict=True):
        assert (p is None) == (q is None), i
        if p is not None and q is not None:
            assert p.keys() == q.keys() and all(_close(p[t].logprob, q[t].logprob) for t in p), i


async def run_mix(
    path: Path,
    prompts: list[tuple[int, ...]],
    params: Callable[[int], SamplingParams],
    **config: Any,
) -> tuple[list[Outcome], EngineStatistics]:
    """Every prompt at once, each its own task: its output, or how it failed alone."""
    outs: list[Outcome | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        try:
            outs[i] = await engine.generate(list(prompts[i]), params(i))
        except RequestFailedError as exc:
            outs[i] = exc

    with anyio.fail_after(240):
        async with running_engine(path, **config) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            assert all(o is not None for o in outs)
            return [o for o in outs if o is not None], engine.statistics()


@pytest.mark.parametrize("mix", [0, 1, 2])
async def test_random_mixes_give_the_sync_engines_outputs(
    mix: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(MODEL)
    rng = random.Random(mix)
    prompts = make_prompts(NUM_REQUESTS, seed=100 + mix, max_len=30)
    chosen = [mixed_params(rng, i) for i in range(NUM_REQUESTS)]

    def params(i: int) -> SamplingParams:
        return chosen[i]

    sync, _ = await run_mix(path, prompts, params, async_scheduling=False,
                         executor_backend="thread", num_device_blocks=128)  # fmt: skip
    configs: list[dict[str, Any]] = [
        {"executor_backend": "process", "num_device_blocks": 16, "preemption_mode": "swap"},
        {"executor_backend": "process", "num_device_blocks": 16, "preemption_mode": "recompute"},
        {"executor_backend": "thread", "num_device_blocks": 128},
    ]
    for config in configs:
        outs, stats = await run_mix(path, prompts, params, async_scheduling=True, **config)
        assert stats.num_steps_planned_ahead > 0, (config, stats)
        for i, (old, new) in enumerate(zip(sync, outs, strict=True)):
            assert_same(old, new, i)


@pytest.mark.parametrize("mix", [0, 19])
async def test_random_mixes_with_prompt_lookup_give_the_sync_engines_outputs(
    mix: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """The same menu over prompts that repeat themselves, with prompt-lookup speculation and
    async scheduling (only the steps between proposals go ahead), in the runner's process
    under memory pressure with the prefix cache and on the thread: the outputs of the sync
    engine without speculation (greedy and prompt lookup's seeded tokens do not depend on
    what was proposed; requests with logprobs or a grammar do not speculate)."""
    path = tiny_checkpoint(MODEL)
    rng = random.Random(1000 + mix)
    base = make_prompts(NUM_REQUESTS, seed=200 + mix, max_len=12)
    prompts = [tuple((list(p) * 4)[: rng.randint(len(p), 4 * len(p))]) for p in base]
    chosen = [mixed_params(rng, i) for i in range(NUM_REQUESTS)]

    def params(i: int) -> SamplingParams:
        return chosen[i]

    sync, _ = await run_mix(path, prompts, params, async_scheduling=False,
                         executor_backend="thread", num_device_blocks=128)  # fmt: skip
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3)  # fmt: skip
    configs: list[dict[str, Any]] = [
        {"executor_backend": "process", "num_device_blocks": 16, "preemption_mode": "swap"},
        {"executor_backend": "thread", "num_device_blocks": 16, "preemption_mode": "recompute",
         "enable_prefix_caching": True},
    ]  # fmt: skip
    for config in configs:
        outs, stats = await run_mix(path, prompts, params, async_scheduling=True,
                                    speculative_config=spec, **config)  # fmt: skip
        assert stats.num_steps_planned_ahead > 0 and stats.num_draft_tokens > 0, (config, stats)
        for i, (old, new) in enumerate(zip(sync, outs, strict=True)):
            assert_same(old, new, i)
