"""The bf16-screened greedy LM head is exact: property tests with adversarial near-ties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.model.lm_head import FP32_UNIT_ROUNDOFF, ScreenedLMHead

# Hypothesis arguments of near_tie_head (shared with the int8 head's tests).
NEAR_TIES = {
    "seed": st.integers(0, 2**31 - 1),
    "vocab": st.integers(2, 600),
    "hidden": st.sampled_from([8, 64, 80, 512]),
    "spread": st.sampled_from([0.0, 1e-7, 1e-5, 1e-3, 1e-1]),
    "noise": st.sampled_from([0.01, 1.0, 30.0]),
    "ties": st.integers(1, 5),
}


def near_tie_head(
    seed: int, vocab: int, hidden: int, spread: float, noise: float, ties: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights whose exact logits for ``h`` are ``c + spread * k_j`` (k_j small integers, many
    repeated) plus a large component orthogonal to ``h`` that bf16 (or int8) rounding turns into
    error. Shared with the int8 head's tests."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(hidden, generator=gen, dtype=torch.float64)
    targets = 3.0 + spread * torch.randint(0, ties, (vocab,), generator=gen).double()
    ortho = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * noise
    ortho -= (ortho @ h)[:, None] * h[None, :] / (h @ h)  # remove the component along h
    weight = ortho + targets[:, None] * h[None, :] / (h @ h)
    return h.float()[None, :], weight.float()


def _exact_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h.double() @ weight.double().T  # [N, V]


def _check(head: ScreenedLMHead, h: torch.Tensor) -> None:
    exact = _exact_logits(h, head.weight)
    rows, cols = head.screen(h)
    got = head.argmax(h)
    # fp32 rescoring error of one dot product (any summation order), per row
    rescore = (h.shape[1] * FP32_UNIT_ROUNDOFF * 1.01) * (
        h.double().abs() @ head.weight.double().abs().T
    )
    for r in range(h.shape[0]):
        best = exact[r].max()
        winners = torch.nonzero(exact[r] == best).flatten().tolist()
        candidates = set(cols[rows == r].tolist())
        assert set(winners) <= candidates, "the screen dropped an exact argmax"
        chosen = int(got[r])
        # the pick is the exact argmax up to fp32 rescoring noise; exactly it when no other
        # token is within that noise
        assert exact[r, chosen] >= best - 2 * rescore[r].max()
        close = torch.nonzero(exact[r] >= best - 2 * rescore[r].max()).flatten().tolist()
        if close == winners:
            assert chosen == winners[0]


@settings(max_examples=60, deadline=None)
@given(**NEAR_TIES)
def test_screen_keeps_the_exact_argmax_on_adversarial_near_ties(
    seed: int, vocab: int, hidden: int, spread: float, noise: float, ties: int
) -> None:
    h, weight = near_tie_head(seed, vocab, hidden, spread, noise, ties)
    _check(ScreenedLMHead(weight), h)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 40), scale=st.sampled_from([0.01, 1, 100])
)
def test_screen_on_random_batches_equals_the_float64_argmax(
    seed: int, rows: int, scale: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(2000, 64, generator=gen) * 0.05
    h = torch.randn(rows, 64, generator=gen) * scale
    head = ScreenedLMHead(weight)
    _check(head, h)
    assert torch.equal(head.argmax(h), _exact_logits(h, weight).argmax(-1))


def planted_triple_head() -> tuple[torch.Tensor, torch.Tensor]:
    """A real-sized head [32000, 512] (hidden [64, 512]) whose rows 9, 123 and 7000 are equal;
    row 5 of the hidden states points at them, so its argmax is an exact triple tie."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32000, 512, generator=gen) * 0.05
    weight[7000] = weight[123]
    weight[9] = weight[123]
    h = torch.randn(64, 512, generator=gen)
    h[5] = weight[123] * 100
    return h, weight


def test_exact_ties_go_to_the_lowest_id_and_candidates_stay_few() -> None:
    h, weight = planted_triple_head()
    head = ScreenedLMHead(weight)
    got = head.argmax(h)
    assert int(got[5]) == 9
    assert torch.equal(got, torch.nn.functional.linear(h, weight).argmax(-1))
    rows, _ = head.screen(h)
    assert rows.numel() / 64 < 32, "the bound is far looser than it should be"


def test_nan_hidden_state_falls_back_to_the_full_head() -> None:
    weight = torch.randn(100, 16)
    h = torch.randn(3, 16)
    h[1, 0] = float("nan")
    got = ScreenedLMHead(weight).argmax(h)
    assert torch.equal(got, torch.nn.functional.linear(h, weight).argmax(-1))


def test_no_rows_give_no_tokens() -> None:
    got = ScreenedLMHead(torch.randn(100, 16)).argmax(torch.randn(0, 16))
    assert got.shape == (0,) and got.dtype == torch.int64


def test_rejects_non_fp32_weights() -> None:
    with pytest.raises(ValueError, match="float32"):
        ScreenedLMHead(torch.randn(10, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("n2", [4, 12, 40])
def test_worst_case_bf16_rounding_inversion_is_covered(n2: int) -> None:
    """Token A is the exact argmax, but bf16 rounding pushes every one of A's weights down and
    every one of B's up on the first components: B screens higher than A by about
    ``(H - n2) * 2^-7``, close to the worst case the bound must cover."""
    hidden, n1 = 512, 512 - n2
    tiny = 2.0**-20
    h = torch.ones(1, hidden)
    a = torch.empty(hidden)
    b = torch.empty(hidden)
    a[:n1], b[:n1] = 1 + 2**-8 - tiny, 1 + 2**-8 + tiny  # round to 1 and to 1 + 2^-7
    a[n1:], b[n1:] = 1 + 2**-6, 1 + 2**-7  # exact in bf16; A larger here
    filler = torch.full((30, hidden), 0.5)
    weight = torch.cat([filler, b[None], a[None], filler])  # B = 30, A = 31
    exact = _exact_logits(h, weight)[0]
    assert int(exact.argmax()) == 31
    head = ScreenedLMHead(weight)
    screen = torch.nn.functional.linear(h.bfloat16(), weight.bfloat16()).float()[0]
    assert screen[30] > screen[31], "the construction no longer inverts the screen"
    assert int(head.argmax(h)[0]) == 31
    _check(head, h)
