"""The int8-screened greedy LM head is exact: the argmax of the fp32 logits, the same token as the
bf16-screened head, on random heads, adversarial near ties and constructions that make the int8
screen rank the wrong token first by as much as its error bound allows.

The reference is ``ScreenedLMHead.rescore`` of every token (the fp32 values both screens give
their candidates) and its ``torch.argmax`` (ties: the lowest id).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.model import lm_head_int8
from asyncpaged.model.lm_head import ScreenedLMHead
from asyncpaged.model.lm_head_int8 import (
    MAX_HIDDEN_SIZE,
    Int8ScreenedArgmax,
    int8_activation_limit,
    int8_screen_supported,
)
from tests.model.test_lm_head import NEAR_TIES, near_tie_head, planted_triple_head

needs_int8 = pytest.mark.skipif(
    not int8_screen_supported(), reason="oneDNN int8 linear unavailable or inexact on this CPU"
)


def _reference_logits(head: Int8ScreenedArgmax, h: torch.Tensor) -> torch.Tensor:
    """``rescore`` of every token: [N, V] fp32, bitwise what the candidates carry."""
    vocab = head.vocab_size
    return head.rescorer.rescore(h, torch.arange(vocab).expand(h.shape[0], vocab))


def _check_bound(head: Int8ScreenedArgmax, h: torch.Tensor) -> None:
    """|s - c L| <= e for every token, L the reference and the float64 logits."""
    screen = head._screen(h)
    assert screen is not None
    num_rows, vocab = screen.scores.shape
    rows = torch.arange(num_rows).repeat_interleave(vocab)
    cols = torch.arange(vocab).repeat(num_rows)
    token_error = head._token_error(screen, rows, cols).view(num_rows, vocab)
    row_error = head._row_error(screen)
    assert bool((token_error <= row_error[:, None]).all()), "E must bound every token's e"
    scale = screen.row_scale[:, None]
    for logits in (_reference_logits(head, h).double(), h.double() @ head.weight.double().T):
        gap = (screen.scores.double() - scale * logits).abs()  # [N, V]
        worst = float((gap / token_error).max())
        assert worst <= 1.0, f"the error bound is exceeded by a factor {worst:.3f}"


def _check(head: Int8ScreenedArgmax, h: torch.Tensor, *, bound: bool = True) -> torch.Tensor:
    """The pick equals the reference argmax and ``ScreenedLMHead.argmax``; returns it."""
    got = head.argmax(h)
    assert got is not None, "the int8 screen refused finite hidden states"
    assert got.dtype == torch.int64 and got.shape == (h.shape[0],)
    want = _reference_logits(head, h).argmax(dim=-1)
    assert got.tolist() == want.tolist()
    assert got.tolist() == ScreenedLMHead(head.weight).argmax(h).tolist()
    if bound:
        _check_bound(head, h)
    return got


# 8-bit activations (VNNI) and 7-bit ones (where int16 pair sums would saturate 8-bit): both
# exact on this machine's kernel, the same proof.
LIMITS = pytest.mark.parametrize("limit", [127, 63], ids=["8bit", "7bit"])


@needs_int8
@LIMITS
@pytest.mark.parametrize(
    ("vocab", "hidden", "num_rows"),
    [(100, 16, 7), (2000, 64, 64), (777, 80, 1), (5000, 512, 7), (32000, 128, 3)],
)
def test_random_heads_give_the_reference_argmax(
    vocab: int, hidden: int, num_rows: int, limit: int
) -> None:
    gen = torch.Generator().manual_seed(vocab + hidden)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    weight[: vocab // 3] *= 3  # rows of very different norms
    h = torch.randn(num_rows, hidden, generator=gen)
    h *= torch.logspace(-3, 3, num_rows)[torch.randperm(num_rows, generator=gen)][:, None]
    head = Int8ScreenedArgmax(weight, activation_limit=limit)
    _check(head, h)


@needs_int8
@LIMITS
def test_zero_rows_large_rows_and_mixed_norms_in_one_batch(limit: int) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(3000, 64, generator=gen) * 0.05
    weight[17] = 0.0  # a zero weight row (its scale is the minimum one)
    h = torch.randn(9, 64, generator=gen)
    h[1] = 0.0
    h[2] *= 1e-30  # far below the others, subnormal products in the reference
    h[3] *= 1e20
    h[4, 7] = 3e4  # one huge component: the rest quantises to zero
    h[5] = -0.0
    h[6] *= 1e-6
    head = Int8ScreenedArgmax(weight, rescorer=ScreenedLMHead(weight), activation_limit=limit)
    got = _check(head, h)
    assert int(got[1]) == 0 and int(got[5]) == 0, "all-zero logits tie: the lowest id wins"


@needs_int8
def test_real_sized_head_keeps_few_candidates() -> None:
    h, weight = planted_triple_head()  # row 5's argmax is the triple 9 / 123 / 7000
    head = Int8ScreenedArgmax(weight)
    got = head.argmax(h)
    assert got is not None and int(got[5]) == 9
    assert torch.equal(got, ScreenedLMHead(weight).argmax(h))
    assert torch.equal(got, torch.nn.functional.linear(h, weight).argmax(-1))
    screen = head._screen(h)
    assert screen is not None
    rows, _ = head._candidates(screen)
    assert rows.numel() / 64 < 32, "the bound is far looser than it should be"


@needs_int8
@LIMITS
@settings(max_examples=60, deadline=None)
@given(**NEAR_TIES)
def test_adversarial_near_ties_give_the_reference_argmax(
    seed: int, vocab: int, hidden: int, spread: float, noise: float, ties: int, limit: int
) -> None:
    h, weight = near_tie_head(seed, vocab, hidden, spread, noise, ties)
    _check(Int8ScreenedArgmax(weight, activation_limit=limit), h)


@needs_int8
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 1500),
    hidden=st.sampled_from([16, 33, 64, 256, 512]),
    num_rows=st.integers(1, 8),
    perturbation=st.sampled_from([0.0, 1e-9, 1e-7, 1e-5, 1e-3]),
    num_planted=st.integers(1, 4),
)
def test_planted_twins_of_the_winner_give_the_reference_argmax(
    seed: int, vocab: int, hidden: int, num_rows: int, perturbation: float, num_planted: int
) -> None:
    """Each row's winner gets twins elsewhere in the vocabulary: its weight row plus a tiny
    perturbation (zero: an exact tie), so the fp32 logits differ by far less than the int8
    error and the pick depends on the fp32 rescoring and the lowest-id rule alone."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    h = torch.randn(num_rows, hidden, generator=gen) * 2
    winners = torch.nn.functional.linear(h, weight).argmax(dim=-1)
    for winner in winners.tolist():
        twins = torch.randint(0, vocab, (num_planted,), generator=gen)
        noise = torch.randn(num_planted, hidden, generator=gen) * perturbation
        weight[twins] = weight[winner] * (1 + noise)
    _check(Int8ScreenedArgmax(weight), h, bound=hidden <= 64)


def _activation_rounding_head(hidden: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Hidden state whose int8 rounding error ``r`` (|r_i| just under 1/2) is parallel to token
    ``j``'s weights and antiparallel to token ``k``'s: the screen sees ``k`` ahead by about
    ``1.5 ||r||_1`` while ``j`` wins by ``0.5 ||r||_1``, so ``2E`` must not drop below ``2
    ||r||_1`` (halving it, or leaving out ``||h - q||``, loses ``j``). Returns (h, w, j, k)."""
    n = hidden - 1
    gen = torch.Generator().manual_seed(hidden)
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    h = torch.empty(1, hidden)
    h[0, 0], h[0, 1:] = 127.0, signs * (0.5 - 2.0**-10)  # c = 1, q = (127, 0, ..., 0)
    gap = round(1.5 * n * 0.5)  # screen lead of k, in units of h[0] * w[:, 0] = 127 w[:, 0]
    weight = torch.randn(40, hidden, generator=gen) * 0.01
    weight[:, 0] = -0.9  # fillers far behind
    j, k = 29, 11
    weight[j, 0], weight[j, 1:] = -gap / 2 / 127, signs
    weight[k, 0], weight[k, 1:] = gap / 2 / 127, -signs
    return h, weight, j, k


def _weight_rounding_head(hidden: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Hidden state that int8 holds exactly (entries +-127) and weights whose components
    ``0.45 * scale`` all round to zero, the rounding error parallel to ``h`` for token ``j`` and
    antiparallel for ``k``: the screen ranks ``k`` first, ``j`` wins (see the activation case;
    here leaving out the weight-rounding term loses ``j``). Returns (h, w, j, k)."""
    n = hidden - 1
    gen = torch.Generator().manual_seed(hidden + 1)
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    h = torch.empty(1, hidden)
    h[0, 0], h[0, 1:] = 127.0, 127.0 * signs
    ratio = 0.75 * 0.45 * n / 127  # screen lead of k: 3/4 of the rounding errors' sum
    high, low = 1.0, (1 - ratio) / (1 + ratio)
    weight = torch.randn(40, hidden, generator=gen) * 1e-4
    weight[:, 0] = -0.9  # fillers far behind
    j, k = 3, 30
    weight[j, 0], weight[j, 1:] = low, 0.45 * low / 127 * signs
    weight[k, 0], weight[k, 1:] = high, -0.45 * high / 127 * signs
    return h, weight, j, k


@needs_int8
@pytest.mark.parametrize("hidden", [16, 64, 256])
@pytest.mark.parametrize("kind", ["activation", "weight"])
def test_screen_inversions_close_to_the_bound_are_covered(kind: str, hidden: int) -> None:
    make = _activation_rounding_head if kind == "activation" else _weight_rounding_head
    h, weight, j, k = make(hidden)
    exact = (h.double() @ weight.double().T)[0]
    assert int(exact.argmax()) == j and float(exact[j] - exact[k]) > 0.1
    head = Int8ScreenedArgmax(weight)
    got = _check(head, h)
    assert int(got[0]) == j
    screen = head._screen(h)
    assert screen is not None
    s = screen.scores[0].double()
    pair = head._token_error(screen, torch.zeros(2, dtype=torch.int64), torch.tensor([j, k]))
    lead = float(s[k] - s[j])
    assert lead > 0.5 * float(pair.sum()), "the construction no longer inverts the screen enough"
    # the same with the pair at the other ends of the vocabulary and many rows
    flipped = weight.flip(0).contiguous()
    _check(Int8ScreenedArgmax(flipped), h.expand(5, -1).contiguous())


@needs_int8
@pytest.mark.parametrize(
    ("hidden", "pattern"), [(1, "any"), (2, "any"), (512, "exact"), (512, "equal"), (64, "equal")]
)
def test_bound_holds_where_only_float_rounding_is_left(hidden: int, pattern: str) -> None:
    """Weights that int8 holds exactly (``k * scale``, 16-bit scales), all positive so that the
    errors line up. With ``any`` hidden states at H = 1 the int8 side makes no error and what is
    left is the rounding of the GEMM's float32 output and of the reference's product; with
    hidden states ``q * 2^m`` (``exact``; ``equal``: every entry and weight the same level)
    only the reference's float32 products and sums are left, and a sum of equal terms drifts."""
    gen = torch.Generator().manual_seed(hidden)
    vocab, num_rows = 2000, 64
    levels = torch.randint(1, 128, (vocab, hidden), generator=gen).float()
    levels[:, 0] = 127
    q = torch.randint(1, 128, (num_rows, hidden), generator=gen).float()
    q[:, -1] = 127
    if pattern == "equal":
        levels.fill_(127)
        q.fill_(127)
    scales = (torch.rand(vocab, generator=gen) * 2**16).round() * 2.0**-22 + 2.0**-7  # 16 bits
    weight = levels * scales[:, None]  # exact in float32
    h = q * 2.0 ** torch.randint(-6, 7, (num_rows, 1), generator=gen).float()
    if pattern == "any":
        h = torch.rand(num_rows, hidden, generator=gen) + 1
    head = Int8ScreenedArgmax(weight)
    assert torch.equal(head.weight_scales, scales), "the weights are no longer int8-exact"
    _check(head, h)


@needs_int8
def test_non_finite_hidden_states_give_none() -> None:
    head = Int8ScreenedArgmax(torch.randn(100, 16))
    for bad in (float("nan"), float("inf"), float("-inf")):
        h = torch.randn(3, 16)
        h[1, 4] = bad
        assert head.argmax(h) is None


@needs_int8
def test_logits_that_could_overflow_give_none() -> None:
    head = Int8ScreenedArgmax(torch.randn(100, 16))
    h = torch.randn(2, 16)
    h[0] = 1e37
    assert head.argmax(h) is None
    assert head.argmax(h[1:]) is not None


@needs_int8
def test_no_rows_give_no_tokens() -> None:
    got = Int8ScreenedArgmax(torch.randn(100, 16)).argmax(torch.randn(0, 16))
    assert got is not None and got.shape == (0,) and got.dtype == torch.int64


@needs_int8
def test_failing_onednn_call_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    head = Int8ScreenedArgmax(torch.randn(100, 16))

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no primitive")

    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", broken)
    assert head.argmax(torch.randn(2, 16)) is None


def test_rejects_weights_it_cannot_bound() -> None:
    with pytest.raises(ValueError, match="float32"):
        Int8ScreenedArgmax(torch.randn(10, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="hidden size"):
        Int8ScreenedArgmax(torch.zeros(1, MAX_HIDDEN_SIZE + 1))
    bad = torch.randn(10, 4)
    bad[3, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        Int8ScreenedArgmax(bad)
    with pytest.raises(ValueError, match="same weight"):
        Int8ScreenedArgmax(torch.randn(10, 4), rescorer=ScreenedLMHead(torch.randn(10, 4)))


@pytest.fixture
def fresh_support_check() -> Iterator[None]:
    """``int8_activation_limit`` recomputed inside the test, and again for later tests."""
    int8_activation_limit.cache_clear()
    yield
    int8_activation_limit.cache_clear()


@pytest.mark.usefixtures("fresh_support_check")
def test_unsupported_without_mkldnn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert int8_screen_supported() is False


@pytest.mark.usefixtures("fresh_support_check")
def test_int16_pair_sums_that_saturate_take_7_bit_activations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that adds u8 x s8 products in pairs into saturating int16 (vpmaddubsw, no VNNI)
    is what the probe exists for: 8-bit activations fail on it, 7-bit ones (u8 <= 127, pair sums
    below 2^15) pass, and the screen runs with those."""

    def prepack(weight: torch.Tensor, x_shape: list[int] | None) -> torch.Tensor:
        return weight

    def saturating(
        qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, *args: object
    ) -> torch.Tensor:
        products = qx.long()[:, None, :] * qw.long()[None, :, :]  # [M, V, H]
        pairs = products.view(*products.shape[:2], -1, 2).sum(-1).clamp(-(2**15), 2**15 - 1)
        weight_scales = args[0]
        assert isinstance(weight_scales, torch.Tensor)
        return (pairs.sum(-1) - x_zp * qw.long().sum(-1)).float() * weight_scales

    monkeypatch.setattr(torch.ops.onednn, "qlinear_prepack", prepack)
    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", saturating)
    assert not lm_head_int8._accumulation_is_exact(127)
    assert int8_activation_limit() == 63
    assert int8_screen_supported() is True
    # and with 7-bit activations the saturating kernel screens exactly
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(300, 64, generator=gen)
    hidden = torch.randn(9, 64, generator=gen)
    head = Int8ScreenedArgmax(weight, activation_limit=63)
    want = torch.argmax(torch.nn.functional.linear(hidden, weight), dim=-1)
    assert torch.equal(head.argmax(hidden), want)


@pytest.mark.usefixtures("fresh_support_check")
def test_the_probe_accepts_an_exact_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def prepack(weight: torch.Tensor, x_shape: list[int] | None) -> torch.Tensor:
        return weight

    def exact(
        qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, *args: object
    ) -> torch.Tensor:
        return ((qx.long() - x_zp) @ qw.long().T).float()

    monkeypatch.setattr(torch.ops.onednn, "qlinear_prepack", prepack)
    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", exact)
    assert int8_activation_limit() == 127
    monkeypatch.setattr(lm_head_int8, "_accumulation_is_exact", lambda limit: False)
    int8_activation_limit.cache_clear()
    assert int8_screen_supported() is False


@needs_int8
def test_onednn_limited_to_avx2_takes_7_bit_activations() -> None:
    """oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA, read at its start, so in a child) adds u8 x s8
    pairs into saturating int16 on any CPU: the real kernel, not a simulation, fails the 8-bit
    check and passes the 7-bit one (on this machine's kind AVX512_CORE does the same,
    AVX512_CORE_VNNI passes 8-bit); and the screen's greedy picks there are the fp32 head's."""
    code = (
        "import torch\n"
        "from asyncpaged.model.lm_head_int8 import Int8ScreenedArgmax, int8_activation_limit\n"
        "limit = int8_activation_limit()\n"
        "g = torch.Generator().manual_seed(1)\n"
        "w = torch.randn(4000, 256, generator=g); h = torch.randn(64, 256, generator=g)\n"
        "head = Int8ScreenedArgmax(w, activation_limit=limit)\n"
        "want = torch.argmax(torch.nn.functional.linear(h, w), dim=-1)\n"
        "print(limit, torch.equal(head.argmax(h), want))\n"
    )
    answers = {}
    for isa in ("AVX2", "DEFAULT"):
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        answers[isa] = out.stdout.strip().splitlines()[-1]
    assert answers == {"AVX2": "63 True", "DEFAULT": "127 True"}
