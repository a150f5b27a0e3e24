"""Verification: greedy exactness, sample-identical seeded rows, and the output distribution.

The statistical tests generate the first two tokens of many seeded sequences from a tiny
"model" (8 tokens; the target's distribution at a position depends on the previous token)
with speculation, and compare the joint counts of (first, second) token with the target's
``p0(y0) * p1(y1 | y0)`` by a chi-square test at a false-alarm rate of 1e-4 per test. The
target distribution is the sampler's own (``random_probs`` after ``process_logits``), so the
check covers temperature, top-k, top-p and min-p exactly as decoding applies them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from asyncpaged.errors import NoTokenAllowedError
from asyncpaged.sampling.options import SamplingOptions, derive_generator_key
from asyncpaged.sampling.rejection import verify
from asyncpaged.sampling.sampler import process_logits, random_probs, sample

V = 8
P_VALUE = 1e-4


# ---- a chi-square test without scipy -------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2),
    from the lower one's power series (exact to rounding for the sizes used here)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0.0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > total * 1e-17:
        n += 1
        term *= z / (a + n)
        total += term
    lower = math.exp(a * math.log(z) - z - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def test_chi2_sf_matches_known_quantiles() -> None:
    # (critical value, degrees of freedom, upper tail) from standard tables
    for x, df, tail in ((3.841, 1, 0.05), (18.475, 7, 0.01), (29.877, 7, 1e-4), (67.505, 50, 0.05)):
        assert chi2_sf(x, df) == pytest.approx(tail, rel=2e-3)


def chi_square_p_value(counts: Counter[tuple[int, int]], probs: dict[tuple[int, int], float],
                       n: int) -> float:  # fmt: skip
    """Cells expecting fewer than 5 are pooled; an observation in a zero-probability cell
    fails at once."""
    for cell, count in counts.items():
        assert probs.get(cell, 0.0) > 0.0 or count == 0, f"impossible outcome {cell} drawn"
    stat, cells, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for cell, p in probs.items():
        expected = p * n
        if expected >= 5.0:
            stat += (counts.get(cell, 0) - expected) ** 2 / expected
            cells += 1
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
    if pooled_exp > 0.0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-12)
        cells += 1
    return chi2_sf(stat, cells - 1)


# ---- the tiny model and two-token generation ----------------------------------------------


@dataclass(frozen=True)
class TinyModel:
    """Target logits: ``first`` [V] at position 0, ``after[t]`` [V] after token ``t``; draft
    distributions ``q_first`` [V] and ``q_after[t]`` [V] (draft-model scenarios)."""

    first: torch.Tensor
    after: torch.Tensor
    q_first: torch.Tensor
    q_after: torch.Tensor


def tiny_model(seed: int, draft_closeness: float) -> TinyModel:
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(V, generator=g) * 2.0
    after = torch.randn(V, V, generator=g) * 2.0
    # the draft model: the target's logits plus noise (closeness 1: no noise)
    noise = 1.0 - draft_closeness
    q_first = torch.softmax(first + noise * 3.0 * torch.randn(V, generator=g), -1)
    q_after = torch.softmax(after + noise * 3.0 * torch.randn(V, V, generator=g), -1)
    return TinyModel(first, after, q_first, q_after)


def options_for(base: SamplingOptions, seed: int, position: int) -> SamplingOptions:
    """``base`` seeded with ``seed`` at generated position ``position`` (sequence index 0)."""
    return SamplingOptions(
        temperature=base.temperature, top_p=base.top_p, top_k=base.top_k, min_p=base.min_p,
        seed=seed, generator_key=derive_generator_key(seed, 0, position),
    )  # fmt: skip


def target_probs(logits: torch.Tensor, base: SamplingOptions) -> torch.Tensor:
    opts = [base] * logits.shape[0]
    return random_probs(process_logits(logits, opts), opts)


Drafter = Callable[[torch.Tensor, int], tuple[list[list[int]], torch.Tensor | None]]


def generate_two(model: TinyModel, base: SamplingOptions, drafts: Drafter, num: int,
                 first_seed: int = 0) -> list[tuple[int, int]]:  # fmt: skip
    """The first two tokens of ``num`` seeded sequences (seeds ``first_seed..``) with two
    proposals, then (if only one token came out) one proposal for the second token."""
    seeds = list(range(first_seed, first_seed + num))
    # first verification: proposals x0, x1 for positions 0 and 1
    prev = torch.full((num,), -1, dtype=torch.int64)
    props, q = drafts(prev, 2)
    rows, opts = [], []
    for i, (x0, x1) in enumerate(props):
        rows += [model.first, model.after[x0], model.after[x1]]
        opts += [options_for(base, seeds[i], j) for j in range(3)]
    out = verify(torch.stack(rows), props, opts, draft_probs=q)
    pairs: dict[int, tuple[int, int]] = {}
    need = [i for i, toks in enumerate(out.token_ids) if len(toks) < 2]
    for i, toks in enumerate(out.token_ids):
        if len(toks) >= 2:
            pairs[i] = (toks[0], toks[1])
    if need:  # second verification: the second token, after a rejection in the first
        prev = torch.tensor([out.token_ids[i][0] for i in need])
        props2, q2 = drafts(prev, 1)
        rows, opts = [], []
        for n, i in enumerate(need):
            y0, x = out.token_ids[i][0], props2[n][0]
            rows += [model.after[y0], model.after[x]]
            opts += [options_for(base, seeds[i], j) for j in (1, 2)]
        out2 = verify(torch.stack(rows), props2, opts, draft_probs=q2)
        for n, i in enumerate(need):
            pairs[i] = (out.token_ids[i][0], out2.token_ids[n][0])
    return [pairs[i] for i in range(num)]


def fixed_drafts(first: int, then: Callable[[int], int]) -> Drafter:
    """One-hot (ngram-like) proposals: ``first`` at position 0, ``then(prev)`` after it."""

    def drafter(prev: torch.Tensor, k: int) -> tuple[list[list[int]], None]:
        out = []
        for t in prev.tolist():
            x0 = first if t < 0 else then(t)
            out.append([x0, then(x0)][:k])
        return out, None

    return drafter


def model_drafts(model: TinyModel, seed: int) -> Drafter:
    """Proposals drawn from the draft distributions, with those distributions."""
    g = torch.Generator().manual_seed(seed)

    def drafter(prev: torch.Tensor, k: int) -> tuple[list[list[int]], torch.Tensor]:
        q0 = torch.stack([model.q_first if t < 0 else model.q_after[t] for t in prev.tolist()])
        x0 = torch.multinomial(q0, 1, generator=g)[:, 0]
        if k == 1:
            return [[int(x)] for x in x0], q0
        q1 = model.q_after[x0]
        x1 = torch.multinomial(q1, 1, generator=g)[:, 0]
        q = torch.stack([q0, q1], dim=1).reshape(-1, V)  # per sequence: q0 row, then q1 row
        return [[int(a), int(b)] for a, b in zip(x0, x1, strict=True)], q

    return drafter


def expected_pairs(model: TinyModel, base: SamplingOptions) -> dict[tuple[int, int], float]:
    p0 = target_probs(model.first[None], base)[0]
    p1 = target_probs(model.after, base)  # [V, V]: row t is p1(. | t)
    return {(a, b): float(p0[a] * p1[a, b]) for a in range(V) for b in range(V)}


BASES = {
    "temperature": SamplingOptions(temperature=0.8),
    "top_k+top_p": SamplingOptions(temperature=1.3, top_k=5, top_p=0.85),
    "min_p": SamplingOptions(temperature=1.0, min_p=0.08),
}
NUM = 12000


def ranked(probs: torch.Tensor) -> list[int]:
    return torch.argsort(probs, descending=True, stable=True).tolist()


@pytest.mark.parametrize("base_name", list(BASES))
@pytest.mark.parametrize("which", ["likely", "unlikely"])
def test_one_hot_proposals_keep_the_target_distribution(base_name: str, which: str) -> None:
    base = BASES[base_name]
    model = tiny_model(1, draft_closeness=1.0)
    p0 = target_probs(model.first[None], base)[0]
    p1 = target_probs(model.after, base)
    # likely: the target's favourite; unlikely: its least likely token (often 0 after top-k)
    pick = 0 if which == "likely" else -1
    after = [ranked(p1[t])[pick] for t in range(V)]
    drafter = fixed_drafts(ranked(p0)[pick], after.__getitem__)
    pairs = generate_two(model, base, drafter, NUM)
    p_value = chi_square_p_value(Counter(pairs), expected_pairs(model, base), NUM)
    assert p_value > P_VALUE, f"speculated tokens do not follow the target (p = {p_value:.2e})"


@pytest.mark.parametrize("base_name", list(BASES))
@pytest.mark.parametrize("closeness", [0.9, 0.0])
def test_draft_distributions_keep_the_target_distribution(base_name: str, closeness: float) -> None:
    base = BASES[base_name]
    model = tiny_model(2, draft_closeness=closeness)
    pairs = generate_two(model, base, model_drafts(model, 5), NUM)
    p_value = chi_square_p_value(Counter(pairs), expected_pairs(model, base), NUM)
    assert p_value > P_VALUE, f"speculated tokens do not follow the target (p = {p_value:.2e})"


def test_the_chi_square_check_catches_a_biased_sampler() -> None:
    """The test has power: sampling the first token from the draft instead fails it."""
    base = BASES["temperature"]
    model = tiny_model(2, draft_closeness=0.0)
    g = torch.Generator().manual_seed(0)
    y0 = torch.multinomial(model.q_first, NUM, replacement=True, generator=g)
    p1 = target_probs(model.after, base)
    y1 = torch.multinomial(p1[y0], 1, generator=g)[:, 0]
    pairs = list(zip(y0.tolist(), y1.tolist(), strict=True))
    assert chi_square_p_value(Counter(pairs), expected_pairs(model, base), NUM) < P_VALUE


# ---- exactness -------------------------------------------------------------------------------


def flat_rows(per_seq: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(per_seq))


def test_greedy_accepts_the_argmax_prefix_and_adds_the_target_token() -> None:
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(k + 1, 50, generator=g) for k in (3, 3, 3, 0, 2)]
    argmax = [lg.argmax(-1).tolist() for lg in logits]
    drafts = [
        argmax[0][:3],  # all accepted: 3 + the bonus token
        [argmax[1][0], (argmax[1][1] + 1) % 50, argmax[1][2]],  # the second is wrong
        [(argmax[2][0] + 7) % 50, argmax[2][1], argmax[2][2]],  # the first is wrong
        [],  # nothing proposed: plain decoding
        argmax[4][:2],
    ]
    out = verify(flat_rows(logits), drafts, [None] * sum(len(lg) for lg in logits))
    assert out.num_accepted == (3, 1, 0, 0, 2)
    assert out.token_ids == (
        tuple(argmax[0]), tuple(argmax[1][:2]), (argmax[2][0],), (argmax[3][0],), tuple(argmax[4])
    )  # fmt: skip
    offsets = [0, 4, 8, 12, 13]
    want_rows = [off + j for off, toks in zip(offsets, out.token_ids, strict=True)
                 for j in range(len(toks))]  # fmt: skip
    assert out.row_indices.tolist() == want_rows
    assert out.errors == {}


def test_greedy_rows_apply_penalties_per_position() -> None:
    """Options per row (the history extended by the proposals) change the argmax as the
    sampler's processing does: the output is greedy sampling's, position by position."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 20, generator=g)
    logits[:, 5] += 4.0  # token 5 wins unless penalised
    drafts = [[5, 5, 5]]
    history = (5,)
    opts = [
        SamplingOptions(temperature=0.0, repetition_penalty=3.0, prompt_token_ids=(1,),
                        output_token_ids=history + (5,) * j)
        for j in range(4)
    ]  # fmt: skip
    out = verify(logits, drafts, opts)
    want = sample(logits, opts).token_ids.tolist()
    a = out.num_accepted[0]
    assert list(out.token_ids[0]) == want[: a + 1]
    assert all(want[j] == 5 for j in range(a))
    assert a == 3 or want[a] != 5


def test_seeded_one_hot_rows_draw_exactly_what_sample_draws() -> None:
    """The coupling: a seeded sequence's tokens are those of non-speculative decoding."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=g)
    base = SamplingOptions(temperature=0.9, top_k=10, seed=77)
    opts = [options_for(base, 77, 10 + j) for j in range(4)]
    plain = [int(sample(logits[j : j + 1], [opts[j]]).token_ids[0]) for j in range(4)]
    for drafts in ([plain[0], plain[1], plain[2]], [plain[0], (plain[1] + 1) % 30, 3]):
        out = verify(logits, [drafts], opts)
        a = out.num_accepted[0]
        assert list(out.token_ids[0]) == plain[: a + 1]
        assert a == (3 if drafts[1] == plain[1] else 1)


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    g = torch.Generator().manual_seed(6)
    model = tiny_model(7, draft_closeness=0.5)
    logits_a = torch.stack([model.first, model.after[2], model.after[3]])
    q_a = torch.stack([model.q_first, model.q_after[2]])
    base = SamplingOptions(temperature=1.0, seed=11)
    opts_a = [options_for(base, 11, j) for j in range(3)]
    alone = verify(logits_a, [[2, 3]], opts_a, draft_probs=q_a)
    other_logits = torch.randn(2, V, generator=g)
    other_opts = [SamplingOptions(temperature=1.0)] * 2  # unseeded: the shared generator
    batched = verify(
        torch.cat([other_logits, logits_a]), [[1], [2, 3]], other_opts + opts_a,
        draft_probs=torch.cat([torch.softmax(other_logits[:1], -1), q_a]),
        generator=torch.Generator().manual_seed(99),
    )  # fmt: skip
    assert batched.token_ids[1] == alone.token_ids[0]
    assert verify(logits_a, [[2, 3]], opts_a, draft_probs=q_a).token_ids == alone.token_ids


def test_impossible_proposals_are_rejected_and_a_perfect_draft_is_kept() -> None:
    model = tiny_model(8, draft_closeness=1.0)
    base = SamplingOptions(temperature=1.0, top_k=2)
    p0 = target_probs(model.first[None], base)[0]
    outside = ranked(p0)[-1]  # probability 0 after top-k
    logits = torch.stack([model.first, model.after[outside]])
    for seed in range(50):
        opts = [options_for(base, seed, j) for j in range(2)]
        assert verify(logits, [[outside]], opts).num_accepted == (0,)
        q = p0[None].clone()  # the draft is the target itself: always accepted
        x = int(torch.multinomial(p0, 1, generator=torch.Generator().manual_seed(seed)))
        logits_x = torch.stack([model.first, model.after[x]])
        assert verify(logits_x, [[x]], opts, draft_probs=q).num_accepted == (1,)


def test_a_failing_logits_processor_fails_its_own_sequence() -> None:
    def broken(history: list[int], row: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("user code")

    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(9))
    bad = SamplingOptions(temperature=0.0, logits_processors=(broken,))
    out = verify(logits, [[1], [2, 3]], [None, None, bad, bad, bad])
    assert set(out.errors) == {1}
    assert isinstance(out.errors[1], RuntimeError)


def test_a_sequence_whose_kept_rows_allow_no_token_fails_alone() -> None:
    """Sequence 1's constraints rule out every token (allowed ids all banned): it fails with
    NoTokenAllowedError, greedy or seeded; sequence 0 and a rejected row's context do not."""
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(9))
    for temperature, seed in ((0.0, None), (0.8, 3)):
        none = SamplingOptions(temperature=temperature, seed=seed, allowed_token_ids=(4,),
                               banned_token_ids=(4,))  # fmt: skip
        some = SamplingOptions(temperature=temperature, seed=seed, allowed_token_ids=(4, 5))
        out = verify(logits, [[1], [2, 3]], [some, some, none, none, none])
        assert set(out.errors) == {1}
        assert isinstance(out.errors[1], NoTokenAllowedError)
        # a row past the first rejection is never kept, so it fails nothing
        out = verify(logits, [[1], [2, 3]], [some, some, some, some, none])
        assert not out.errors
    # drawn proposals (a draft model's distributions): the kept tokens are checked, not the
    # rows' unused draws
    draft_probs = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(2)), -1)
    for fails in (False, True):
        last = SamplingOptions(temperature=0.8, seed=3, allowed_token_ids=(4,),
                               banned_token_ids=(4,) if fails else ())  # fmt: skip
        out = verify(logits, [[1], [2, 3]], [last, last, last, last, last], draft_probs=draft_probs)
        assert set(out.errors) == ({0, 1} if fails else set())


def test_inconsistent_inputs_are_assertion_errors() -> None:
    logits = torch.randn(3, 10)
    with pytest.raises(AssertionError, match="target rows"):
        verify(logits, [[1, 2, 3]], [None] * 3)
    with pytest.raises(AssertionError, match="disagree on greedy"):
        verify(logits, [[1, 2]], [None, SamplingOptions(temperature=1.0), None])
    with pytest.raises(AssertionError, match="draft_probs"):
        verify(logits, [[1, 2]], [None] * 3, draft_probs=torch.ones(1, 10))
