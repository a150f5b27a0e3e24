"""Speculative decoding with a draft model, end to end.

The draft keeps its own paged KV cache over the target's block ids, runs every step's batch and
proposes from scratch blocks (``asyncpaged.worker.draft``). Drafts here: the target itself (every
greedy proposal must be accepted: its cache must hold exactly what the target's holds, through
swaps, recompute and copy-on-write), the target with its weights perturbed (some proposals
rejected), and another family (other layers and heads). Greedy output must equal transformers'
token for token; seeded sampling must be reproducible and follow the stop rules. Every engine is
leak-checked on exit (``running_engine``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineConfig, RequestOutput, SamplingParams, SpeculativeConfig
from asyncpaged.errors import InvalidRequestError
from asyncpaged.testing.tiny_models import build_tiny_model, build_tokenizer
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.engine.test_speculative import _sampled
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _spec(model: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=str(model))


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("model", ["llama-gqa", "opt", "gpt2"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_target_as_its_own_draft_accepts_every_proposal(
    model: str,
    mode: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """The draft's cache mirrors the target's (same slots, swaps, recompute), so the target's
    own greedy proposals are all accepted and the tokens are transformers'."""
    path, ref = tiny_checkpoint(model), hf_reference(model)
    prompts = make_prompts(12, seed=7)
    with anyio.fail_after(240):
        async with running_engine(path, num_device_blocks=12, preemption_mode=mode,
                                  speculative_config=_spec(path)) as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 20)[0], prompt
    assert stats.num_preemptions > 0
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats


@pytest.mark.parametrize("model", ["llama-gqa", "opt"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_perturbed_draft_is_exact_and_rejects_some(
    model: str,
    mode: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    perturbed_draft: Callable[[str], Path],
) -> None:
    path, ref = tiny_checkpoint(model), hf_reference(model)
    prompts = make_prompts(12, seed=8)
    spec = _spec(perturbed_draft(model))
    with anyio.fail_after(240):
        async with running_engine(path, num_device_blocks=12, preemption_mode=mode,
                                  speculative_config=spec) as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 20)[0], prompt
    assert stats.num_preemptions > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


async def test_draft_of_another_family_is_exact(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """A draft with other layers, heads and head size (GPT-2 for a GQA Llama), proposing past
    block boundaries (k=6, blocks of 4: up to three scratch blocks per sequence): exact
    whatever it proposes."""
    path, ref = tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa")
    prompts = make_prompts(8, seed=9)
    with anyio.fail_after(240):
        async with running_engine(path, block_size=4, num_device_blocks=48,
                                  speculative_config=_spec(tiny_checkpoint("gpt2"), k=6)
                                  ) as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 20)[0], prompt
    assert stats.num_draft_tokens > 0


async def test_parallel_sampling_and_prefix_cache_with_self_draft(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """Prefix-cache hits and forks (n=2 greedy: both completions share the prompt's blocks,
    copy-on-write) keep the draft's cache equal to the target's: every proposal accepted."""
    path, ref = tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa")
    shared = tuple(range(40, 75))
    prompts = [shared + p for p in make_prompts(6, seed=10, max_len=12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    with anyio.fail_after(240):
        async with running_engine(path, enable_prefix_caching=True,
                                  speculative_config=_spec(path)) as engine:  # fmt: skip
            first = await generate_all(engine, prompts, params)
            again = await generate_all(engine, prompts, params)
            stats = engine.statistics()
    for prompt, a, b in zip(prompts, first, again, strict=True):
        expected = ref.generate(prompt, 16)[0]
        assert [c.token_ids for c in a.outputs] == [expected, expected], prompt
        assert [c.token_ids for c in b.outputs] == [expected, expected], prompt
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats


async def test_sampled_proposals_are_verified_against_their_draft_distribution(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Random rows keep the draft's ``q`` for verification: with the target as its own draft,
    ``q`` equals the target's ``p`` (up to summation order), so ``u * q(x) < p(x)`` accepts
    nearly every proposal; verified as one-hot proposals, only about ``p(x)`` of them would
    be."""
    path = tiny_checkpoint("llama-gqa")
    prompts = make_prompts(8, seed=13)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    with anyio.fail_after(240):
        async with running_engine(path, speculative_config=_spec(path)) as engine:
            outs = await generate_all(engine, prompts, lambda i: params[i])
            stats = engine.statistics()
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert stats.num_draft_tokens > 50, stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, stats


def _check_stop_rules(out: RequestOutput, params: SamplingParams, eos: int) -> None:
    for c in out.outputs:
        assert len(c.token_ids) <= params.max_tokens
        assert eos not in c.token_ids[:-1], c.token_ids
        if c.finish_reason == "length":
            assert len(c.token_ids) == params.max_tokens
        else:
            assert c.finish_reason == "stop", c.finish_reason
            assert c.token_ids[-1] == eos
            assert len(c.token_ids) >= params.min_tokens


async def test_seeded_sampling_is_reproducible_and_follows_stop_rules(
    tiny_checkpoint: Callable[[str], Path], perturbed_draft: Callable[[str], Path]
) -> None:
    """Proposals are drawn from the draft's distribution, verified by rejection sampling: the
    same seed gives the same output (each request alone, two engines), and every output obeys
    max_tokens, min_tokens and EOS, also under memory pressure with concurrent requests."""
    path = tiny_checkpoint("llama-gqa")
    prompts = make_prompts(12, seed=12)
    spec = _spec(perturbed_draft("llama-gqa"))
    runs: list[list[RequestOutput]] = []
    with anyio.fail_after(300):
        for _ in range(2):
            async with running_engine(path, speculative_config=spec) as engine:
                eos = engine._eos
                runs.append(
                    [await engine.generate(list(p), _sampled(i)) for i, p in enumerate(prompts)]
                )
                stats = engine.statistics()
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
        async with running_engine(path, num_device_blocks=16, preemption_mode="swap",
                                  speculative_config=spec) as engine:  # fmt: skip
            concurrent = await generate_all(engine, prompts, _sampled)
    (eos_id,) = eos
    for i, (a, b, c) in enumerate(zip(*runs, concurrent, strict=True)):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs], i
        for out in (a, c):
            _check_stop_rules(out, _sampled(i), eos_id)
            assert len(out.outputs) == _sampled(i).n


async def test_draft_model_refusals(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Another vocabulary, fewer positions than max_model_len and the KV tiers are refused
    at start (tensor parallelism runs it: tests/distributed)."""
    path = tiny_checkpoint("llama-gqa")
    model = build_tiny_model("gpt2")
    model.resize_token_embeddings(400)
    model.save_pretrained(str(tmp_path / "wide"))
    build_tokenizer().save_pretrained(str(tmp_path / "wide"))
    refused = [
        {"speculative_config": _spec(tmp_path / "wide")},
        {"speculative_config": _spec(path), "kv_offload_host_bytes": 1 << 20},
        {"speculative_config": _spec(tiny_checkpoint("llama-rope-dynamic"))},  # 16 positions
    ]
    for config in refused:
        with pytest.raises(InvalidRequestError):
            async with AsyncEngine(EngineConfig(model=str(path), dtype="float32", **config)):
                pass
