"""Every model family through the whole engine: concurrent requests under memory pressure
(preemption by swap and by recompute), greedy tokens equal to one-at-a-time transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import SamplingParams, SpeculativeConfig
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio

#: One tiny checkpoint per family added for real use (the older ones: tests/engine/test_engine).
FAMILIES = ["qwen3", "qwen3-moe", "mixtral", "gemma2", "gemma3", "gemma3-multimodal", "phi3-swa"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("name", FAMILIES)
async def test_family_under_memory_pressure_matches_transformers(
    name: str,
    mode: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    path, ref = tiny_checkpoint(name), hf_reference(name)
    prompts = make_prompts(12, seed=4)  # 15, 16, 17, 1, 32, 33 tokens and 6 more up to 40
    with anyio.fail_after(120):
        async with running_engine(path, num_device_blocks=7, preemption_mode=mode) as engine:
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], (name, len(prompt))
    assert stats.num_preemptions > 0
    assert (stats.num_swap_outs > 0) == (mode == "swap")
    assert stats.num_rope_restarts == 0


@pytest.mark.parametrize("name", ["phi3-longrope", "phi4-mini"])
async def test_longrope_requests_match_transformers_generate(
    name: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """longrope (switch at 20 tokens): requests that grow past the switch restart in the long
    regime, as transformers' Phi-3 ``generate`` recomputes its cache; a long prompt prefilled
    in chunks rotates with the long factors from its first chunk; short- and long-regime
    blocks never serve each other through the prefix cache."""
    path, ref = tiny_checkpoint(name), hf_reference(name)
    base = tuple(range(40, 70))
    prompts = [base[:15], base[:16], base[:17], base[:12], base[:30], base[:24], base[:18]]
    with anyio.fail_after(120):
        async with running_engine(path, max_num_batched_tokens=8) as engine:
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], (name, len(prompt))
    crossing = sum(len(p) <= 20 < len(p) + 10 for p in prompts)
    assert stats.num_rope_restarts == crossing
    # The short prompts share blocks with each other (same regime) but the long ones miss.
    assert stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("name", ["phi3-longrope", "phi4-mini"])
async def test_longrope_speculation_never_verifies_past_the_switch(
    name: str,
    async_scheduling: bool,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Prompt lookup on repeating prompts: proposals stop at the longrope switch (20 tokens),
    so no verification step computes positions past it in the short regime (transformers
    rotates those with the long factors); the request restarts long when it crosses, as
    without speculation. Greedy tokens equal transformers'."""
    path, ref = tiny_checkpoint(name), hf_reference(name)
    prompts = [(123,) * 4, (40, 41) * 3, (7, 8, 9) * 4, tuple(range(50, 60)) * 2]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=1,
                             prompt_lookup_max=3)  # fmt: skip
    with anyio.fail_after(120):
        async with running_engine(path, speculative_config=spec,
                                  async_scheduling=async_scheduling) as engine:  # fmt: skip
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            outs = await generate_all(engine, prompts, params)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 24)[0], (name, prompt)
    assert stats.num_draft_tokens > 0, stats
    assert stats.num_rope_restarts == len(prompts)  # each crosses the switch


async def test_longrope_parallel_samples_cross_the_switch_in_their_own_step(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """n = 2 with prompt lookup: kept proposals set the two sequences apart, so one reaches
    longrope's switch first. It waits there while the other catches up; then the request
    restarts in the long regime. Each token is thus sampled in the regime its own sequence's
    length picks, and the seeded samples equal the engine's without speculation (where the
    sequences cross together)."""
    path = tiny_checkpoint("phi4-mini")
    prompts = [(241, 30, 167, 174, 110, 241, 30, 167), (40, 41) * 4, (7, 8, 9) * 3]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3)  # fmt: skip
    outs = []
    for config in ({}, {"speculative_config": spec}):
        with anyio.fail_after(120):
            async with running_engine(path, **config) as engine:
                results = []
                for seed in range(1010, 1022):
                    params = SamplingParams(n=2, temperature=0.9, seed=seed, max_tokens=24,
                                            ignore_eos=True)  # fmt: skip
                    results += await generate_all(engine, prompts, params)
                stats = engine.statistics()
        outs.append([[c.token_ids for c in r.outputs] for r in results])
    assert outs[1] == outs[0]
    assert stats.num_accepted_tokens > 0, stats
