"""The sampler against independent per-row references (plain Python loops, float64).

Processors are checked one at a time on random logits, then through ``sample``: every drawn token
must lie in the set the reference keeps, seeded rows must not depend on the rest of the batch,
and draws must follow the reference distribution (a chi-square bound, deterministic seeds).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from asyncpaged.errors import NoTokenAllowedError
from asyncpaged.sampling import sampler as sampler_module
from asyncpaged.sampling.logits import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    penalize_rows_,
)
from asyncpaged.sampling.options import SamplingOptions, derive_generator_key
from asyncpaged.sampling.sampler import draw_tokens, sample

VOCAB = 50

# ---- references: one row at a time, no torch ---------------------------------------------------


def _softmax(row: Sequence[float]) -> list[float]:
    finite = [x for x in row if x != -math.inf]
    top = max(finite)
    weights = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
    total = sum(weights)
    return [w / total for w in weights]


def _ref_top_k(row: Sequence[float], k: int) -> set[int]:
    """Tokens whose logit is at least the k-th largest (ties at the boundary kept)."""
    threshold = sorted(row, reverse=True)[k - 1]
    return {i for i, x in enumerate(row) if x >= threshold}


def _ref_top_p(row: Sequence[float], p: float, allowed: set[int] | None = None) -> set[int]:
    """Among ``allowed`` (renormalised), keep a token while the mass ranked above it is < p."""
    allowed = set(range(len(row))) if allowed is None else allowed
    probs = _softmax([x if i in allowed else -math.inf for i, x in enumerate(row)])
    kept, above = set(), 0.0
    for i in sorted(allowed, key=lambda i: (-probs[i], i)):
        if above < p or not kept:
            kept.add(i)
        above += probs[i]
    return kept


def _ref_min_p(row: Sequence[float], min_p: float) -> set[int]:
    probs = _softmax(row)
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def _ref_penalties(
    row: Sequence[float],
    prompt: Sequence[int],
    output: Sequence[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> list[float]:
    out = list(row)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in Counter(output).items():
        out[token] -= frequency * count + presence
    return out


def _random_logits(
    rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0
) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row != -math.inf).flatten().tolist()) for row in logits]


# ---- processors one at a time -------------------------------------------------------------------


def test_repetition_penalty_matches_transformers_processor() -> None:
    rng = random.Random(0)
    logits = _random_logits(4)
    penalties = [1.3, 0.7, 2.0, 1.0]
    prompts = [tuple(rng.randrange(VOCAB) for _ in range(n)) for n in (5, 0, 9, 3)]
    outputs = [tuple(rng.randrange(VOCAB) for _ in range(n)) for n in (4, 6, 0, 2)]
    got = apply_penalties(
        logits,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        repetition_penalties=torch.tensor(penalties),
        frequency_penalties=torch.zeros(4),
        presence_penalties=torch.zeros(4),
    )
    for r in range(4):
        history = torch.tensor([prompts[r] + outputs[r]], dtype=torch.int64)
        want = RepetitionPenaltyLogitsProcessor(penalties[r])(history, logits[r : r + 1].clone())
        torch.testing.assert_close(got[r : r + 1], want, rtol=1e-6, atol=0.0)
        assert got[r].tolist() == pytest.approx(
            _ref_penalties(logits[r].tolist(), prompts[r], outputs[r], penalties[r], 0.0, 0.0),
            rel=1e-6,
        )
    assert not torch.equal(got[0], logits[0]), "the penalty changed nothing"


def test_frequency_and_presence_penalties_follow_the_formula() -> None:
    rng = random.Random(1)
    logits = _random_logits(3, seed=1)
    params = [(1.1, 0.5, -0.3), (1.0, -1.0, 2.0), (1.0, 0.0, 0.0)]
    prompts = [tuple(rng.randrange(VOCAB) for _ in range(8)) for _ in range(3)]
    outputs = [tuple(rng.randrange(10) for _ in range(12)) for _ in range(3)]  # repeats
    got = apply_penalties(
        logits,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        repetition_penalties=torch.tensor([p[0] for p in params]),
        frequency_penalties=torch.tensor([p[1] for p in params]),
        presence_penalties=torch.tensor([p[2] for p in params]),
    )
    for r, (rep, freq, pres) in enumerate(params):
        want = _ref_penalties(logits[r].tolist(), prompts[r], outputs[r], rep, freq, pres)
        assert got[r].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert torch.equal(got[2], logits[2]), "no-op penalties must leave the row bit-identical"


def _dense_penalties(
    logits: torch.Tensor,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    params: Sequence[tuple[float, float, float]],
) -> torch.Tensor:
    """The dense form over [R, V] (vLLM v1's): every logit goes through every operation."""
    num_rows, vocab = logits.shape
    out_counts = torch.zeros(num_rows, vocab)
    prompt_seen = torch.zeros(num_rows, vocab, dtype=torch.bool)
    for r in range(num_rows):
        for i in outputs[r]:
            out_counts[r, i] += 1.0
        for i in prompts[r]:
            prompt_seen[r, i] = True
    rep = torch.tensor([p[0] for p in params])[:, None]
    freq = torch.tensor([p[1] for p in params])[:, None]
    pres = torch.tensor([p[2] for p in params])[:, None]
    seen = (out_counts > 0) | prompt_seen
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    dense = torch.where(seen, scaled, logits)
    dense -= freq * out_counts
    dense -= pres * (out_counts > 0)
    return dense


@pytest.mark.parametrize("form", ["numpy", "torch"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sparse_penalties_are_bit_identical_to_the_dense_form(
    seed: int, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged histories (empty rows, repeats, the first and last ids, prompt-only tokens, lists
    as well as tuples), penalties on and off per row, rows in any order: every logit equals the
    dense computation's exactly (-0.0 and 0.0 compare equal: only a zero's sign may differ),
    in the numpy form CPU tensors take and in the torch form of other devices."""
    from asyncpaged.sampling import logits as logits_processors

    monkeypatch.setattr(logits_processors, "_on_host", lambda _: form == "numpy")
    rng = random.Random(seed)
    num_rows = 9
    logits = _random_logits(num_rows, seed=seed)
    logits[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    prompts: list[Sequence[int]] = [
        tuple(rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))) for _ in range(num_rows)
    ]
    outputs: list[Sequence[int]] = [
        [rng.randrange(12) for _ in range(rng.randint(0, 30))] for _ in range(num_rows)
    ]
    prompts[0], outputs[0] = (0, 1, 2, 3), (0, 1, VOCAB - 1, VOCAB - 1)
    outputs[1] = ()
    params = [(rng.choice([1.0, 0.8, 1.3]), rng.choice([0.0, 0.7, -0.4]),
               rng.choice([0.0, 1.5, -0.2])) for _ in range(num_rows)]  # fmt: skip
    params[2] = (1.0, 0.0, 0.0)
    want = _dense_penalties(logits, prompts, outputs, params)
    assert not torch.equal(want, logits), "the penalties changed nothing"
    got = logits.clone()
    order = list(range(num_rows))
    rng.shuffle(order)
    penalize_rows_(
        got,
        order,
        prompt_token_ids=[prompts[r] for r in order],
        output_token_ids=[outputs[r] for r in order],
        repetition_penalties=torch.tensor([params[r][0] for r in order]),
        frequency_penalties=torch.tensor([params[r][1] for r in order]),
        presence_penalties=torch.tensor([params[r][2] for r in order]),
    )
    assert torch.equal(got, want)
    assert torch.equal(got[2], logits[2]), "no-op penalties must leave the row bit-identical"


def test_penalties_touch_only_the_rows_named() -> None:
    logits = _random_logits(3, seed=5)
    got = logits.clone()
    penalize_rows_(got, [1], prompt_token_ids=[(3, 4)], output_token_ids=[(4, 4, 9)],
                   repetition_penalties=torch.tensor([1.2]),
                   frequency_penalties=torch.tensor([0.5]),
                   presence_penalties=torch.tensor([0.25]))  # fmt: skip
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    params = [(1.0, 0.0, 0.0), (1.2, 0.5, 0.25), (1.0, 0.0, 0.0)]
    want = _dense_penalties(logits, [(), (3, 4), ()], [(), (4, 4, 9), ()], params)
    assert torch.equal(got, want)
    assert not torch.equal(got[1], logits[1])


def test_penalty_token_ids_are_checked() -> None:
    logits = _random_logits(2)
    for bad in (VOCAB, -1):
        with pytest.raises(AssertionError, match="token id"):
            apply_penalties(logits, prompt_token_ids=[(), ()], output_token_ids=[(1,), (bad,)],
                            repetition_penalties=torch.ones(2),
                            frequency_penalties=torch.ones(2),
                            presence_penalties=torch.zeros(2))  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_keeps_the_reference_set(seed: int) -> None:
    logits = _random_logits(5, seed=seed)
    logits[4, :6] = torch.tensor([9.0, 7.0, 7.0, 7.0, 7.0, 1.0])  # ties at the k-th value
    ks = [1, 3, 17, VOCAB, 2]
    got = apply_top_k_top_p(logits, torch.tensor(ks), None)
    for r, k in enumerate(ks):
        assert _kept(got)[r] == _ref_top_k(logits[r].tolist(), k)
    assert _kept(got)[4] >= {0, 1, 2, 3, 4}
    finite = got != -math.inf
    assert torch.equal(got[finite], logits[finite]), "kept logits must be unchanged"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_alone_and_after_top_k_keeps_the_reference_set(seed: int) -> None:
    logits = _random_logits(6, seed=seed, scale=1.5)
    ps = [0.05, 0.3, 0.6, 0.9, 0.99, 1.0]
    got = apply_top_k_top_p(logits, None, torch.tensor(ps))
    for r, p in enumerate(ps):
        assert _kept(got)[r] == _ref_top_p(logits[r].tolist(), p), (r, p)
    ks = [3, 10, 40, VOCAB, 5, 20]
    both = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for r, (k, p) in enumerate(zip(ks, ps, strict=True)):
        row = logits[r].tolist()
        assert _kept(both)[r] == _ref_top_p(row, p, _ref_top_k(row, k)), (r, k, p)
    assert _kept(got)[5] == set(range(VOCAB))


@pytest.mark.parametrize("seed", [0, 1])
def test_min_p_keeps_the_reference_set(seed: int) -> None:
    logits = _random_logits(4, seed=seed, scale=2.0)
    min_ps = [0.0, 0.05, 0.3, 1.0]
    got = apply_min_p(logits, torch.tensor(min_ps))
    for r, m in enumerate(min_ps):
        assert _kept(got)[r] == _ref_min_p(logits[r].tolist(), m)
    assert len(_kept(got)[3]) == 1


# ---- through sample() ---------------------------------------------------------------------------


def _draw(logits: torch.Tensor, options: SamplingOptions, num: int, seed: int = 0) -> list[int]:
    """``num`` draws of one row (repeated as a batch) with an unseeded generator."""
    batch = logits.expand(num, -1).contiguous()
    out = sample(batch, [options] * num, generator=torch.Generator().manual_seed(seed))
    return list(out.token_ids.tolist())


def test_greedy_paths_equal_the_argmax() -> None:
    logits = _random_logits(8, seed=3)
    top2 = logits.topk(2).values
    assert bool((top2[:, 0] - top2[:, 1] > 1e-2).all()), "test data needs a clear argmax"
    argmax = [max(range(VOCAB), key=lambda i, row=row: row[i]) for row in logits.tolist()]
    variants = [
        None,
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=1e-6),  # below the greedy threshold
        SamplingOptions(temperature=1e-4),  # random path, but the softmax is one-hot
        SamplingOptions(top_k=1),
        SamplingOptions(top_p=1e-6),
        SamplingOptions(top_p=1e-9),  # 1 - top_p rounds to 1.0 in float32
        SamplingOptions(min_p=1.0),
    ]
    for options in variants:
        if options is not None:
            for r in range(8):
                assert set(_draw(logits[r], options, 50)) == {argmax[r]}, (options, r)
        out = sample(logits, [options] * 8, generator=torch.Generator().manual_seed(0))
        assert out.token_ids.tolist() == argmax, options


@pytest.mark.parametrize(
    "options",
    [
        SamplingOptions(top_k=4),
        SamplingOptions(top_p=0.5),
        SamplingOptions(min_p=0.2),
        SamplingOptions(temperature=0.5, top_k=8, top_p=0.7),
        SamplingOptions(temperature=1.7, min_p=0.1, top_p=0.8),
    ],
)
def test_draws_stay_in_the_reference_set(options: SamplingOptions) -> None:
    row = _random_logits(1, seed=4, scale=1.5)[0]
    scaled = [x / options.temperature for x in row.tolist()]
    allowed = set(range(VOCAB))
    if options.min_p:  # vLLM v1 order: min-p, then top-k, then top-p
        allowed = _ref_min_p(scaled, options.min_p)
    masked = [x if i in allowed else -math.inf for i, x in enumerate(scaled)]
    if options.top_k:
        allowed &= _ref_top_k(masked, options.top_k)
    allowed = _ref_top_p(masked, options.top_p, allowed)
    drawn = set(_draw(row, options, 2000))
    assert drawn <= allowed
    assert len(drawn) >= min(len(allowed), 3), "suspiciously few distinct draws"


def test_penalties_and_min_tokens_mask_change_greedy_rows() -> None:
    logits = _random_logits(3, seed=5)
    output = tuple(int(i) for i in logits[0].topk(3).indices)  # the top three, all generated
    options = [
        SamplingOptions(
            temperature=0.0,
            presence_penalty=2.0,
            frequency_penalty=1.0,
            repetition_penalty=1.5,
            output_token_ids=output,
            prompt_token_ids=(7,),
        ),
        SamplingOptions(temperature=0.0, min_tokens_mask_ids=tuple(range(0, VOCAB, 2))),
        None,
    ]
    got = sample(logits, options).token_ids.tolist()
    penalized = _ref_penalties(logits[0].tolist(), (7,), output, 1.5, 1.0, 2.0)
    assert got[0] == max(range(VOCAB), key=lambda i: penalized[i])
    assert got[1] == max(range(1, VOCAB, 2), key=lambda i: float(logits[1, i]))
    assert got[2] == int(logits[2].argmax())


def test_min_tokens_mask_is_never_sampled() -> None:
    logits = _random_logits(1, seed=6)[0]
    eos_and_stops = (2, 5, 11)
    logits[list(eos_and_stops)] = 20.0  # overwhelmingly likely unless masked
    for options in (
        SamplingOptions(min_tokens_mask_ids=eos_and_stops),
        SamplingOptions(temperature=3.0, min_tokens_mask_ids=eos_and_stops),
        SamplingOptions(temperature=0.0, min_tokens_mask_ids=eos_and_stops),
        SamplingOptions(seed=3, generator_key=9, min_tokens_mask_ids=eos_and_stops),
    ):
        drawn = _draw(logits, options, 1000)
        assert not set(drawn) & set(eos_and_stops)
    assert set(_draw(logits, SamplingOptions(), 200)) <= set(eos_and_stops)


def _seeded_rows() -> list[tuple[torch.Tensor, SamplingOptions]]:
    logits = _random_logits(4, vocab=1000, seed=7, scale=0.5)
    return [
        (logits[0], SamplingOptions(seed=1, generator_key=derive_generator_key(1, 0, 0))),
        (logits[1], SamplingOptions(temperature=0.8, top_p=0.9, seed=2, generator_key=12345)),
        (logits[2], SamplingOptions(top_k=50, min_p=0.01, seed=3, generator_key=2**62 + 7)),
        (
            logits[3],
            SamplingOptions(
                seed=4, generator_key=0, repetition_penalty=1.2, output_token_ids=(1, 2, 3)
            ),
        ),
    ]


def test_seeded_rows_ignore_batch_composition_and_order() -> None:
    rows = _seeded_rows()
    alone = [int(sample(lg[None], [o]).token_ids[0]) for lg, o in rows]
    others = _random_logits(5, vocab=1000, seed=8)
    extra: list[tuple[torch.Tensor, SamplingOptions | None]] = [
        (others[0], SamplingOptions()),
        (others[1], None),
        (others[2], SamplingOptions(temperature=2.0, seed=99, generator_key=5)),
        (others[3], SamplingOptions(top_k=3)),
    ]
    for trial in range(4):
        mixed: list[tuple[torch.Tensor, SamplingOptions | None]] = [*rows, *extra[:trial]]
        order = list(range(len(mixed)))
        random.Random(trial).shuffle(order)
        batch = torch.stack([mixed[i][0] for i in order])
        out = sample(
            batch, [mixed[i][1] for i in order], generator=torch.Generator().manual_seed(trial)
        ).token_ids.tolist()
        for pos, i in enumerate(order):
            if i < len(rows):
                assert out[pos] == alone[i], (trial, i)


def test_different_generator_keys_draw_differently() -> None:
    row = torch.zeros(1, 1000)  # uniform: 20 equal draws would be a 1e-57 event
    draws = {
        int(sample(row, [SamplingOptions(seed=0, generator_key=k)]).token_ids[0]) for k in range(20)
    }
    assert len(draws) > 10
    keys = {derive_generator_key(s, i, n) for s in (0, 1, -1) for i in (0, 1) for n in range(5)}
    assert len(keys) == 30
    assert all(0 <= k < 2**63 for k in keys)


def _chi_square(counts: Counter[int], probs: Sequence[float], num: int) -> float:
    return sum((counts.get(i, 0) - num * p) ** 2 / (num * p) for i, p in enumerate(probs) if p > 0)


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_softmax(seeded: bool) -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.2]])
    probs = _softmax(logits[0].tolist())
    num = 4000 if seeded else 40000
    if seeded:
        options = [SamplingOptions(seed=0, generator_key=k) for k in range(num)]
        drawn = sample(logits.expand(num, -1), options).token_ids.tolist()
    else:
        drawn = _draw(logits[0], SamplingOptions(), num, seed=1)
    # chi-square, 7 degrees of freedom: P(X > 24.32) = 0.001
    assert _chi_square(Counter(drawn), probs, num) < 24.32


def test_temperature_and_top_k_renormalise() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.2])
    keep = _ref_top_k(logits.tolist(), 3)  # {0, 4, 7}
    probs = _softmax([x / 0.7 if i in keep else -math.inf for i, x in enumerate(logits.tolist())])
    num = 30000
    drawn = _draw(logits, SamplingOptions(temperature=0.7, top_k=3), num, seed=2)
    assert set(drawn) == keep
    # 2 degrees of freedom among the kept tokens: P(X > 13.82) = 0.001
    assert _chi_square(Counter(drawn), probs, num) < 13.82


def test_logprobs_are_raw_with_ranks_and_top_n() -> None:
    logits = _random_logits(4, vocab=200, seed=9)
    options = [
        SamplingOptions(
            temperature=0.6, num_logprobs=5, repetition_penalty=2.0, output_token_ids=(1, 2)
        ),
        SamplingOptions(num_logprobs=0),
        None,
        SamplingOptions(temperature=0.0, num_logprobs=3, min_tokens_mask_ids=(0, 1, 2)),
    ]
    logits[3, 1] = 50.0  # masked argmax: the sampled token has rank 2
    out = sample(logits, options, want_logprobs=True, generator=torch.Generator().manual_seed(0))
    assert out.logprobs is not None
    assert out.ranks is not None
    assert out.top_token_ids is not None
    assert out.top_logprobs is not None
    assert out.top_token_ids.shape == (4, 5)
    for r in range(4):
        row = logits[r].double()
        reference = (row - row.exp().sum().log()).tolist()  # log-softmax of the raw logits
        token = int(out.token_ids[r])
        assert float(out.logprobs[r]) == pytest.approx(reference[token], abs=1e-5)
        assert int(out.ranks[r]) == sum(x >= reference[token] for x in reference)
        by_logprob = sorted(range(200), key=lambda i: -reference[i])
        assert out.top_token_ids[r].tolist() == by_logprob[:5]
        assert out.top_logprobs[r].tolist() == pytest.approx(
            [reference[i] for i in by_logprob[:5]], abs=1e-5
        )
        topk = torch.topk(row, 200).indices.tolist()
        assert topk.index(token) + 1 == int(out.ranks[r])
    assert int(out.ranks[3]) == 2


def test_invalid_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingOptions(top_p=1.5)
    with pytest.raises(ValueError, match="top_k must be"):
        SamplingOptions(top_k=-1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingOptions(repetition_penalty=0.0)


@given(
    probs=st.lists(
        st.lists(st.one_of(st.just(0.0), st.floats(1e-30, 1.0)), min_size=1, max_size=12),
        min_size=1,
        max_size=6,
    ),
    us=st.lists(
        st.one_of(st.just(0.0), st.just(1.0 - 2.0**-53), st.floats(0.0, 1.0, exclude_max=True)),
        min_size=6,
        max_size=6,
    ),
)
def test_inverse_cdf_picks_the_first_token_whose_cumulative_integer_weight_exceeds_u(
    probs: list[list[float]], us: list[float]
) -> None:
    """Against Python integers: weight ``floor(p * 2**52)``, target ``floor(u * total)`` (at
    most ``total - 1``), the first token whose cumulative weight exceeds it; a zero-weight
    token is never picked, and padding a row with zero weights anywhere changes nothing."""

    width = max(len(row) for row in probs)
    rows = [row + [0.0] * (width - len(row)) for row in probs]
    rows = [row if max(row) >= 2.0**-40 else [*row[:-1], 0.5] for row in rows]  # some weight
    table = torch.tensor(rows, dtype=torch.float32)
    u = torch.tensor(us[: len(rows)], dtype=torch.float64)
    got = sampler_module._inverse_cdf(table, u).tolist()
    for r, row in enumerate(table.tolist()):
        weights = [int(p * 2**52) for p in row]  # exact: p is a float32, 2**52 a power of two
        total = sum(weights)
        target = min(int(float(u[r]) * total), total - 1)
        cumulative, want = 0, None
        for v, w in enumerate(weights):
            cumulative += w
            if cumulative > target:
                want = v
                break
        assert got[r] == want and weights[got[r]] > 0
    spread = torch.zeros(len(rows), 3 * width)
    spread[:, 1::3] = table  # zeros between and around: the same tokens, at 3v + 1
    assert [3 * v + 1 for v in got] == sampler_module._inverse_cdf(spread, u).tolist()


def test_seeded_rows_draw_from_their_key_alone_and_unseeded_from_the_generator() -> None:
    """A seeded row's token depends only on its generator key (not on the batch, its row or
    the step generator); unseeded rows consume one float64 draw each from the generator."""
    probs = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(0)), -1)
    opts = [
        SamplingOptions(temperature=1.0, seed=7 if r % 2 else None, generator_key=1000 + r)
        for r in range(5)
    ]
    g = torch.Generator().manual_seed(3)
    got = draw_tokens(probs, opts, g)
    after = torch.Generator().manual_seed(3)
    u = torch.rand(3, dtype=torch.float64, generator=after)
    assert torch.equal(g.get_state(), after.get_state())
    for slot, r in enumerate((0, 2, 4)):  # the generator's draws, in row order
        assert int(got[r]) == int(sampler_module._inverse_cdf(probs[r : r + 1], u[slot : slot + 1]))
    reversed_batch = draw_tokens(probs.flip(0), opts[::-1], torch.Generator().manual_seed(5))
    for r in (1, 3):  # alone or in a reversed batch, with other generators: the same token
        alone = draw_tokens(probs[r : r + 1], [opts[r]], torch.Generator().manual_seed(99))
        assert int(alone) == int(got[r]) == int(reversed_batch[4 - r])
    assert len({int(t) for t in got}) > 1


def test_logit_controls_in_vllms_order_and_never_screened() -> None:
    """allowed_token_ids mask, then logit_bias, then the banned (bad-word) tokens, before the
    penalties; raw logprobs stay the unprocessed ones; no screened shortcut takes such rows."""
    from asyncpaged.sampling.sampler import is_screenable

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    opts = [
        SamplingOptions(temperature=0.0, allowed_token_ids=(0, 1, 2), logit_bias=((0, 1.5),)),
        SamplingOptions(
            temperature=0.0, banned_token_ids=(0,), logit_bias=((4, 3.5),), num_logprobs=0
        ),
    ]
    out = sample(logits, opts)
    # row 0: allowed {0, 1, 2} -> [0, 1, 2] + bias 1.5 on 0 -> 2 (2.0 beats 1.5)
    # row 1: 0 banned, 4 biased to 3.5 -> 4 (3.5 beats 3.0)
    assert out.token_ids.tolist() == [2, 4]
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, raw[torch.arange(2), out.token_ids])
    assert not any(is_screenable(o, 5) for o in opts)
    assert is_screenable(SamplingOptions(temperature=0.0), 5)


def test_a_row_whose_constraints_allow_no_token_gets_an_error() -> None:
    """Allowed ids all banned (greedy and random rows, on the full path): the row's error is
    NoTokenAllowedError; rows that allow a token, or have no constraint, get none."""
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    none = SamplingOptions(temperature=0.0, allowed_token_ids=(3, 4), banned_token_ids=(3, 4))
    random_none = SamplingOptions(temperature=0.7, seed=5, allowed_token_ids=(6,),
                                  banned_token_ids=(6,))  # fmt: skip
    some = SamplingOptions(temperature=0.7, seed=5, allowed_token_ids=(6, 7), banned_token_ids=(6,))
    out = sample(logits, [none, None, random_none, some])
    assert set(out.errors) == {0, 2}
    assert all(isinstance(e, NoTokenAllowedError) for e in out.errors.values())
    assert out.token_ids[3].item() == 7 and out.token_ids[1].item() == logits[1].argmax().item()


def test_options_pickle_only_their_own_bitmask_row() -> None:
    """A step's bitmasks are views of one buffer; pickled for the runner's process, each row
    carries its own mask, not the buffer's storage (which made a step's plan quadratic in its
    constrained rows: 6.3 MB at 128 rows), and comes back equal."""
    import pickle

    buffer = torch.randint(-(2**31), 2**31 - 1, (128, 96), dtype=torch.int32)
    options = [SamplingOptions(temperature=0.0, seed=i, token_bitmask=row)
               for i, row in enumerate(buffer.unbind(0))]  # fmt: skip
    data = pickle.dumps(options, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(data) < 128 * 96 * 4 * 2, len(data)  # each row's 384 bytes, not the buffer's
    back = pickle.loads(data)
    for a, b in zip(options, back, strict=True):
        assert b.token_bitmask is not None and torch.equal(a.token_bitmask, b.token_bitmask)
        assert b.seed == a.seed and b.temperature == 0.0
    plain = SamplingOptions(temperature=0.7, top_k=5, seed=9)
    assert pickle.loads(pickle.dumps(plain)) == plain
