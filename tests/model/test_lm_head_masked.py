"""The screened LM heads under a grammar's bitmask (structured outputs): the argmax over each
row's allowed tokens, exactly the token the unscreened path (full head, bitmask, argmax) gives,
with masked and unmasked rows in one batch, and the runner sends masked greedy rows to them.

The reference is ``ScreenedLMHead.rescore`` of every token (the fp32 values the screens give
their candidates) with -inf at the disallowed tokens, and its ``torch.argmax``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.model.lm_head import ScreenedLMHead
from asyncpaged.model.lm_head_int8 import Int8ScreenedArgmax, int8_screen_supported
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.sampling.sampler import sample
from asyncpaged.structured_outputs import bitmask_to_allowed, grammar_mask_bias
from tests.model.test_lm_head import NEAR_TIES, near_tie_head

needs_int8 = pytest.mark.skipif(
    not int8_screen_supported(), reason="oneDNN int8 linear unavailable or inexact on this CPU"
)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V / 32)] int32, xgrammar's layout."""
    vocab = allowed.shape[0]
    bits = torch.zeros(-(-vocab // 32) * 32, dtype=torch.int64)
    bits[:vocab] = allowed.long()
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _bias(allowed: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> the heads' mask bias (0 allowed, -inf not), through the bitmasks."""
    bias = grammar_mask_bias([_bitmask(a) for a in allowed], allowed.shape[1], allowed.device)
    assert bias is not None
    assert torch.equal(bias == 0, allowed)
    return bias


def _reference(head: ScreenedLMHead, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    vocab = head.vocab_size
    logits = head.rescore(h, torch.arange(vocab).expand(h.shape[0], vocab))
    return logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)


def _random_case(
    seed: int, vocab: int, hidden: int, num_rows: int, density: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    weight[: vocab // 3] *= 3
    h = torch.randn(num_rows, hidden, generator=gen)
    masks = torch.rand(num_rows, vocab, generator=gen) < density
    masks[:, 0] |= ~masks.any(dim=-1)  # at least one allowed token per row
    bitmasks: list[torch.Tensor | None] = [
        None if r % 3 == 2 else _bitmask(masks[r]) for r in range(num_rows)
    ]
    bias = grammar_mask_bias(bitmasks, vocab, h.device)
    assert bias is not None
    return weight, h, bias == 0, bitmasks


def test_bitmask_to_allowed_matches_xgrammar() -> None:
    """The byte-table decoding equals the bits xgrammar sets and its own in-place mask."""
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(3)
    for vocab in (31, 32, 33, 3072, 32001):
        bm = torch.randint(-(2**31), 2**31 - 1, (4, -(-vocab // 32)), dtype=torch.int32,
                           generator=gen)  # fmt: skip
        got = bitmask_to_allowed(bm, vocab)
        shifts = torch.arange(32, dtype=torch.int32)
        want = ((bm[..., None] >> shifts) & 1).flatten(-2)[..., :vocab].bool()
        assert torch.equal(got, want)
        logits = torch.randn(4, vocab, generator=gen)
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bm)
        assert torch.equal(masked, logits.masked_fill(~got, float("-inf")))
    assert torch.equal(bitmask_to_allowed(_bitmask(torch.tensor([True, False] * 20)), 40),
                       torch.tensor([True, False] * 20))  # fmt: skip


@pytest.mark.parametrize(
    ("vocab", "hidden", "density"),
    [(100, 16, 0.3), (3072, 192, 0.02), (5000, 64, 0.001), (777, 80, 0.9)],
)
@pytest.mark.parametrize("screen", ["bf16", pytest.param("int8", marks=needs_int8)])
def test_masked_screens_equal_the_unscreened_path(
    vocab: int, hidden: int, density: float, screen: str
) -> None:
    weight, h, allowed, bitmasks = _random_case(vocab + hidden, vocab, hidden, 12, density)
    bf16 = ScreenedLMHead(weight)
    head = bf16 if screen == "bf16" else Int8ScreenedArgmax(weight, rescorer=bf16)
    got = head.argmax(h, grammar_mask_bias(bitmasks, vocab, h.device))
    assert got is not None
    assert got.tolist() == _reference(bf16, h, allowed).tolist()
    assert bool(allowed[torch.arange(h.shape[0]), got].all()), "a disallowed token was picked"
    # the unscreened path: full fp32 head, the sampler's bitmask, argmax
    opts = [None if b is None else SamplingOptions(temperature=0.0, token_bitmask=b)
            for b in bitmasks]  # fmt: skip
    full = sample(h @ weight.T, opts).token_ids
    assert got.tolist() == full.tolist()
    unmasked = [r for r, b in enumerate(bitmasks) if b is None]
    assert got[unmasked].tolist() == head.argmax(h[unmasked]).tolist()  # type: ignore[union-attr]


@settings(max_examples=40, deadline=None)
@given(**NEAR_TIES, keep=st.integers(1, 2**31 - 1))
def test_masked_screens_on_adversarial_near_ties(
    seed: int, vocab: int, hidden: int, spread: float, noise: float, ties: int, keep: int
) -> None:
    """Near ties of the allowed tokens, with the best disallowed tokens ruled out."""
    h, weight = near_tie_head(seed, vocab, hidden, spread, noise, ties)
    gen = torch.Generator().manual_seed(keep)
    allowed = torch.rand(1, vocab, generator=gen) < 0.5
    allowed[0, int(torch.randint(0, vocab, (1,), generator=gen))] = True
    bf16 = ScreenedLMHead(weight)
    want = _reference(bf16, h, allowed).tolist()
    assert bf16.argmax(h, _bias(allowed)).tolist() == want
    if int8_screen_supported():
        got = Int8ScreenedArgmax(weight, rescorer=bf16).argmax(h, _bias(allowed))
        assert got is not None and got.tolist() == want


@needs_int8
def test_zero_rows_pick_the_lowest_allowed_id_and_empty_masks_give_up() -> None:
    weight = torch.randn(300, 32, generator=torch.Generator().manual_seed(1)) * 0.05
    bf16 = ScreenedLMHead(weight)
    head = Int8ScreenedArgmax(weight, rescorer=bf16)
    h = torch.zeros(2, 32)
    allowed = torch.zeros(2, 300, dtype=torch.bool)
    allowed[0, [7, 9]] = True
    allowed[1] = True
    assert head.argmax(h, _bias(allowed)).tolist() == [7, 0]  # type: ignore[union-attr]
    assert bf16.argmax(h, _bias(allowed)).tolist() == [7, 0]
    allowed[1] = False  # no allowed token: the int8 screen refuses, the bf16 one falls back
    assert head.argmax(h, _bias(allowed)) is None
    assert bf16.argmax(h, _bias(allowed)).tolist() == sample(h @ weight.T, [
        SamplingOptions(temperature=0.0, token_bitmask=_bitmask(a)) for a in allowed
    ]).token_ids.tolist()  # fmt: skip


def test_runner_sends_masked_greedy_rows_to_the_screen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows whose only control is a bitmask take the screened head; any other control
    (or a sampled row) keeps the full path."""
    from asyncpaged.worker.protocol import SequenceStep
    from asyncpaged.worker.protocol import plain_greedy as plain

    step = SequenceStep(seq_id=1, token_ids=(1,), num_computed_tokens=0, slot_mapping=(0,),
                        block_table=(0,), do_sample=True)  # fmt: skip
    bitmask = _bitmask(torch.ones(40, dtype=torch.bool))
    assert plain(step, SamplingOptions(temperature=0.0, token_bitmask=bitmask))
    assert not plain(step, SamplingOptions(temperature=0.0, token_bitmask=bitmask,
                                           logit_bias=((3, 1.0),)))  # fmt: skip
    assert not plain(step, SamplingOptions(temperature=1.0, token_bitmask=bitmask))
    assert not plain(step, SamplingOptions(temperature=0.0, banned_token_ids=(3,)))


@pytest.mark.parametrize("poison", ["none", "nan", "posinf", "neginf"])
@pytest.mark.parametrize("every_row", [True, False])
def test_sampler_masks_like_masked_fill(poison: str, every_row: bool) -> None:
    """The sampler's bitmask (a 0 / -inf bias added, masked_fill when a logit is NaN or +inf)
    gives exactly ``masked_fill`` of the disallowed tokens, in place or on a subset of rows."""
    from asyncpaged.sampling.sampler import apply_logit_controls

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 200, generator=gen)
    if poison != "none":
        logits[1, 3] = {"nan": float("nan"), "posinf": float("inf"), "neginf": float("-inf")}[
            poison
        ]
    allowed = torch.rand(5, 200, generator=gen) < 0.3
    masked = range(5) if every_row else (0, 1, 3)
    opts = [
        SamplingOptions(temperature=0.0, token_bitmask=_bitmask(allowed[r]))
        if r in masked
        else None
        for r in range(5)
    ]
    want = logits.clone()
    for r in masked:
        want[r] = want[r].masked_fill(~allowed[r], float("-inf"))
    got = logits.clone()
    apply_logit_controls(got, opts)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
