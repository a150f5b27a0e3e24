"""Top-k sampling through the bf16-screened LM head is exact: the same tokens as ``sample`` on the
full fp32 logits, with identically seeded generators, on random and adversarial heads.

The reference logits are ``ScreenedLMHead.rescore`` of every token (the fp32 values the screen
gives its candidates); coverage is also checked against the float64 logits widened by the
error any fp32 evaluation may make, and against ``F.linear`` (the runner's full path).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.model.lm_head import FP32_UNIT_ROUNDOFF, ScreenedLMHead, TopKCandidates
from asyncpaged.sampling import sampler
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.sampling.sampler import (
    MAX_SCREENED_TOP_K,
    is_screenable,
    sample,
    sample_from_candidates,
    screened_top_k,
)


def _reference_logits(head: ScreenedLMHead, h: torch.Tensor) -> torch.Tensor:
    """``rescore`` of every token: [N, V] fp32, bitwise what the candidates carry."""
    vocab = head.vocab_size
    return head.rescore(h, torch.arange(vocab).expand(h.shape[0], vocab))


def _check_candidates(head: ScreenedLMHead, h: torch.Tensor, ks: list[int]) -> TopKCandidates:
    """Every invariant of ``TopKCandidates``, row by row, against three kinds of logits."""
    got = head.topk_candidates(h, ks)
    assert got is not None
    vocab = head.vocab_size
    reference = _reference_logits(head, h)
    linear = torch.nn.functional.linear(h, head.weight)  # another fp32 evaluation
    exact = h.double() @ head.weight.double().T
    # what any fp32 evaluation may add to the exact logit (one dot product, any order)
    rho = (h.shape[1] * FP32_UNIT_ROUNDOFF) * (h.double().abs() @ head.weight.double().abs().T)
    for r, k in enumerate(ks):
        ids = got.token_ids[r]
        real = ids[ids < vocab]
        assert real.numel() >= k and bool((real[1:] > real[:-1]).all()), "not ascending/distinct"
        assert bool((ids[real.numel() :] == vocab).all()), "padding must come last"
        assert torch.equal(got.logits[r, : real.numel()], reference[r, real]), "not the rescore"
        assert bool((got.logits[r, real.numel() :] == float("-inf")).all())
        members = set(real.tolist())
        for logits in (reference[r], linear[r]):
            kth = logits.topk(k).values[-1]
            assert set(torch.nonzero(logits >= kth).flatten().tolist()) <= members
        kth_exact = exact[r].topk(k).values[-1]
        widened = exact[r] + 2 * rho[r].max()
        assert set(torch.nonzero(widened >= kth_exact).flatten().tolist()) <= members, (
            "a token some fp32 evaluation could rank in the top k is missing"
        )
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[real] = False
        bound = float(got.outside_bound[r])
        assert bound < float(got.logits[r].topk(k).values[-1]), "bound not below the k-th"
        if bool(outside.any()):
            assert float((exact[r] + rho[r])[outside].max()) <= bound, "an outside token exceeds"
    return got


def _check_sampling(
    head: ScreenedLMHead, h: torch.Tensor, opts: list[SamplingOptions | None], seed: int
) -> list[int]:
    """Screened tokens == ``sample`` on the reference logits and on ``F.linear`` logits that
    carry the candidates' values; generators end in the same state. Returns the tokens."""
    candidates = head.topk_candidates(h, screened_top_k(opts))
    assert candidates is not None
    reference = _reference_logits(head, h)
    linear = torch.nn.functional.linear(h, head.weight)
    rows = torch.arange(h.shape[0])[:, None].expand_as(candidates.token_ids)
    real = candidates.token_ids < head.vocab_size
    linear[rows[real], candidates.token_ids[real]] = candidates.logits[real]
    screened_gen = torch.Generator().manual_seed(seed)
    got = sample_from_candidates(candidates, opts, generator=screened_gen)
    assert got is not None, "the screened sampler refused rows it should certify"
    for full in (reference, linear):
        full_gen = torch.Generator().manual_seed(seed)
        want = sample(full, opts, generator=full_gen)
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert torch.equal(screened_gen.get_state(), full_gen.get_state())
    assert got.logprobs is None and got.top_token_ids is None
    return list(got.token_ids.tolist())


def _random_options(
    rng: random.Random, num: int, ks: tuple[int, ...], *, with_top_p: bool
) -> list[SamplingOptions | None]:
    opts: list[SamplingOptions | None] = []
    for _ in range(num):
        if rng.random() < 0.15:
            opts.append(None)
            continue
        opts.append(
            SamplingOptions(
                temperature=rng.choice([0.0, 1e-5, 0.3, 1.0, 1.0, 4.0]),
                top_k=rng.choice(ks),
                top_p=rng.choice([1.0, 0.95, 0.5, 1e-3]) if with_top_p else 1.0,
                seed=rng.choice([None, None, rng.randrange(1000)]),
                generator_key=rng.randrange(2**63),
            )
        )
    return opts


@pytest.mark.parametrize("with_top_p", [False, True])
def test_tokens_equal_the_full_sampler_on_random_heads(with_top_p: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(3000, 64, generator=gen) * 0.05
    h = torch.randn(48, 64, generator=gen) * 4
    head = ScreenedLMHead(weight)
    rng = random.Random(2)
    seen: set[int] = set()
    for step in range(6):
        opts = _random_options(rng, 48, (1, 2, 5, 50), with_top_p=with_top_p)
        seen.update(_check_sampling(head, h, opts, seed=step))
    assert len(seen) > 60, "the draws should spread over many tokens"
    _check_candidates(head, h, [1, 2, 5, 50, MAX_SCREENED_TOP_K, 1] * 8)


def test_exact_ties_at_the_kth_and_top_p_boundaries_are_kept() -> None:
    """Tokens 3 / 40 / 41 / 900 have identical weights and rank 2nd-5th: top-k with k = 2..4
    cuts through the tie, so ``sample`` keeps all four; so must the candidates."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(1000, 32, generator=gen) * 0.05
    h = torch.randn(32, generator=gen)
    weight[7] = h / h.norm() * 0.5  # a clear first
    for tied in (3, 40, 41, 900):
        weight[tied] = h / h.norm() * 0.45
    head = ScreenedLMHead(weight)
    hs = h.expand(64, -1).contiguous()
    counts = dict.fromkeys((7, 3, 40, 41, 900), 0)
    for k in (2, 3, 4):
        for top_p in (1.0, 0.6):
            opts: list[SamplingOptions | None] = [
                SamplingOptions(temperature=0.5, top_k=k, top_p=top_p) for _ in range(64)
            ]
            for token in _check_sampling(head, hs, opts, seed=k):
                counts[token] += 1
    assert all(c > 0 for c in counts.values()), f"every tied token must be drawn: {counts}"
    greedy = _check_sampling(head, hs[:4], [None] * 4, seed=0)
    assert greedy == [7] * 4


def test_probabilities_are_bitwise_those_of_sample() -> None:
    """The race's probabilities, not just its winners: bit for bit ``sample``'s, including rows
    whose ``1 - top_p`` equals one of ``sample``'s own cumulative sums (a top-p cut decided by
    the last bit of a sum: any other summation order shows here)."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(3000, 64, generator=gen) * 0.05
    h = torch.randn(64, 64, generator=gen) * 4
    head = ScreenedLMHead(weight)
    reference = _reference_logits(head, h)
    rng = random.Random(6)
    base = [
        SamplingOptions(temperature=rng.choice([0.3, 1.0, 4.0]), top_k=rng.choice([5, 50, 64]))
        for _ in range(64)
    ]
    # sample's sorted cumulative sums for these rows (the top-p half of apply_top_k_top_p)
    temperature = torch.tensor([o.temperature for o in base])
    scaled = reference / temperature[:, None]
    top_k = torch.tensor([o.top_k for o in base])
    ordered = torch.sort(scaled, dim=-1, stable=True).values
    ordered = ordered.masked_fill(ordered < ordered.gather(1, (3000 - top_k)[:, None]), -torch.inf)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    opts: list[SamplingOptions | None] = []
    for r, o in enumerate(base):
        sums = [c for c in cumulative[r].tolist() if 0.5 <= c < 1.0]
        top_p = 1.0 - rng.choice(sums) if sums and r % 4 else rng.choice([1.0, 0.9])
        opts.append(SamplingOptions(temperature=o.temperature, top_k=o.top_k, top_p=top_p))
    chosen = [o for o in opts if o is not None]
    candidates = head.topk_candidates(h, screened_top_k(opts))
    assert candidates is not None
    got = sampler._candidate_probs(
        candidates.token_ids, candidates.logits, candidates.outside_bound, chosen, 3000
    )
    want = sampler._random_probs(reference, chosen)  # [R, V]
    assert got is not None
    real = candidates.token_ids < 3000
    ids = candidates.token_ids.masked_fill(~real, 0)
    assert torch.equal(got[real], want.gather(1, ids)[real])
    assert float(want.sum(dim=-1).sub(got.sum(dim=-1)).abs().max()) < 1e-6, "mass outside"
    _check_sampling(head, h, opts, seed=6)


def _worst_case_inversion(k: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """k - 1 clear leaders, then A (the exact k-th) and B (k+1-th, 0.006 below), where bf16
    rounding drags A's screen down and lifts B's: B screens 10 above A, 63% of the margin ``2e``
    the bound allows. h rounds down on the first half of the hidden units, up on the second;
    A lives on the first half with weights that round down, B on the second with weights that
    round up, and one tuning unit each puts A's and B's sums just off bf16 rounding midpoints."""
    hidden, tiny = 512, 2.0**-20
    h = torch.empty(hidden, dtype=torch.float64)
    h[:256], h[256:] = 1 + 2**-8 - tiny, 1 + 2**-8 + tiny
    a = torch.zeros(hidden, dtype=torch.float64)
    b = torch.zeros(hidden, dtype=torch.float64)
    a[:256], a[511] = 2 + 2**-7 - tiny, -1.984375
    b[256:511], b[255] = 2 + 2**-7 + tiny, 0.015625
    weight = torch.full((64 * (k + 2), hidden), 0.5, dtype=torch.float64)  # filler
    for i in range(k - 1):  # leaders, each in its own 64-token chunk
        weight[64 * i] = 1.0546875
    a_id, b_id = 64 * k + 5, 64 * k - 60
    weight[a_id], weight[b_id] = a, b
    return h.float()[None], weight.float(), a_id, b_id


@pytest.mark.parametrize("k", [1, 2, 5])
def test_worst_case_bf16_inversion_at_the_kth_boundary_is_covered(k: int) -> None:
    h, weight, a_id, b_id = _worst_case_inversion(k)
    exact = (h.double() @ weight.double().T)[0]
    assert int((exact > exact[a_id]).sum()) == k - 1 and exact[a_id] > exact[b_id]
    head = ScreenedLMHead(weight)
    scores, error = head._scores_and_error(h)
    inversion = float(scores[0, b_id] - scores[0, a_id])
    assert inversion > 0.6 * 2 * float(error[0]), "the construction no longer nears the bound"
    candidates = _check_candidates(head, h, [k])
    assert a_id in candidates.token_ids[0].tolist()
    if k == 1:
        assert int(head.argmax(h)[0]) == a_id
    hs = h.expand(128, -1).contiguous()  # A's probability at T = 30 is ~0.09 (k = 5)
    for temperature in (0.0, 1.0, 30.0):
        opts: list[SamplingOptions | None] = [
            SamplingOptions(temperature=temperature, top_k=k, seed=i, generator_key=i)
            for i in range(128)
        ]
        tokens = _check_sampling(head, hs, opts, seed=0)
        assert b_id not in tokens, "B is outside the top k"
        if temperature == 30.0:
            assert a_id in tokens, "A must be drawn sometimes at a high temperature"


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(70, 700),
    hidden=st.sampled_from([8, 64, 80]),
    spread=st.sampled_from([0.0, 1e-7, 1e-5, 1e-3, 1e-1]),
    noise=st.sampled_from([0.01, 1.0, 30.0]),
    ties=st.integers(1, 5),
    k=st.integers(1, MAX_SCREENED_TOP_K),
    temperature=st.sampled_from([0.0, 0.01, 1.0, 7.0]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
)
def test_adversarial_near_ties_at_the_kth_boundary(
    seed: int,
    vocab: int,
    hidden: int,
    spread: float,
    noise: float,
    ties: int,
    k: int,
    temperature: float,
    top_p: float,
) -> None:
    """Exact logits ``3 + spread * m_j`` (m_j in 0..ties-1, so hundreds of exact ties and
    near-ties around any k-th position) plus a large component orthogonal to h that bf16
    rounding turns into screening error."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(hidden, generator=gen, dtype=torch.float64)
    targets = 3.0 + spread * torch.randint(0, ties, (vocab,), generator=gen).double()
    ortho = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * noise
    ortho -= (ortho @ h)[:, None] * h[None, :] / (h @ h)
    weight = (ortho + targets[:, None] * h[None, :] / (h @ h)).float()
    head = ScreenedLMHead(weight)
    hs = h.float().expand(8, -1).contiguous()
    _check_candidates(head, hs[:1], [k])
    opts: list[SamplingOptions | None] = [
        SamplingOptions(
            temperature=temperature,
            top_k=k,
            top_p=top_p,
            seed=i if i % 2 else None,
            generator_key=i,
        )
        for i in range(8)
    ]
    _check_sampling(head, hs, opts, seed=seed)


def test_matches_the_full_path_on_the_benchmark_shape() -> None:
    """[64, 512] hidden states x a [32000, 512] head, k = 50: the same tokens as ``sample`` on
    ``F.linear`` logits, the runner's full path (its values differ from the rescore in the last
    bits, so this is a check of the common case, not of exactness)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32000, 512, generator=gen) * 0.05
    h = torch.randn(64, 512, generator=gen)
    head = ScreenedLMHead(weight)
    opts: list[SamplingOptions | None] = [
        SamplingOptions(temperature=1.0, top_k=50, seed=i if i % 3 == 0 else None, generator_key=i)
        for i in range(64)
    ]
    candidates = head.topk_candidates(h, screened_top_k(opts))
    assert candidates is not None
    assert candidates.token_ids.shape[1] < 400, "the bound is far looser than it should be"
    got = sample_from_candidates(candidates, opts, generator=torch.Generator().manual_seed(5))
    want = sample(
        torch.nn.functional.linear(h, weight), opts, generator=torch.Generator().manual_seed(5)
    )
    assert got is not None and torch.equal(got.token_ids, want.token_ids)


def test_refuses_before_drawing_when_temperature_scaling_overflows() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(500, 16, generator=gen)
    h = torch.randn(2, 16, generator=gen) * 1e36  # logits ~1e36, / 1e-5 overflows to inf
    head = ScreenedLMHead(weight)
    opts: list[SamplingOptions | None] = [SamplingOptions(temperature=1e-5, top_k=3)] * 2
    candidates = head.topk_candidates(h, screened_top_k(opts))
    assert candidates is not None
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert sample_from_candidates(candidates, opts, generator=generator) is None
    assert torch.equal(generator.get_state(), state), "a refusal must not consume draws"
    fine: list[SamplingOptions | None] = [SamplingOptions(temperature=1.0, top_k=3)] * 2
    assert sample_from_candidates(candidates, fine, generator=generator) is not None


def test_non_finite_hidden_states_give_no_candidates() -> None:
    head = ScreenedLMHead(torch.randn(100, 16))
    h = torch.randn(3, 16)
    h[1, 0] = float("nan")
    assert head.topk_candidates(h, [1, 5, 2]) is None
    h[1, 0] = float("inf")
    assert head.topk_candidates(h, [1, 5, 2]) is None
    empty = head.topk_candidates(torch.randn(0, 16), [])
    assert empty is not None and empty.token_ids.shape == (0, 0)
    out = sample_from_candidates(empty, [])
    assert out is not None and out.token_ids.shape == (0,)


def test_eligibility() -> None:
    vocab = 1000
    assert is_screenable(None, vocab)
    assert is_screenable(SamplingOptions(temperature=0.0), vocab)
    assert is_screenable(SamplingOptions(temperature=0.0, top_p=0.5, min_p=0.2), vocab)
    assert is_screenable(SamplingOptions(top_k=50, top_p=0.9, temperature=0.7, seed=3), vocab)
    assert is_screenable(SamplingOptions(top_k=MAX_SCREENED_TOP_K), vocab)
    not_screenable = [
        SamplingOptions(),  # top-k off: the whole vocabulary is sampled
        SamplingOptions(top_k=MAX_SCREENED_TOP_K + 1),
        SamplingOptions(top_k=5, min_p=0.1),
        SamplingOptions(top_k=5, num_logprobs=0),
        SamplingOptions(temperature=0.0, num_logprobs=2),
        SamplingOptions(top_k=5, repetition_penalty=1.2),
        SamplingOptions(temperature=0.0, presence_penalty=0.5),
        SamplingOptions(top_k=5, frequency_penalty=0.5),
        SamplingOptions(temperature=0.0, min_tokens_mask_ids=(2,)),
    ]
    for opt in not_screenable:
        assert not is_screenable(opt, vocab), opt
    assert not is_screenable(SamplingOptions(top_k=10), 10), "top_k >= vocab means off"
    assert screened_top_k([None, SamplingOptions(temperature=0.0, top_k=9)]) == [1, 1]
    assert screened_top_k([SamplingOptions(top_k=9)]) == [9]
