"""``argmax_rows`` is ``torch.argmax(..., dim=-1)``: the first maximal index per row (the lowest
id among ties, the first NaN where a row has one), on rows with ties, signed zeros, infinities,
NaNs, float64, strided views and empty batches; the sampler's greedy rows go through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.kernels.cpu_argmax import argmax_rows
from asyncpaged.sampling.sampler import greedy

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 3.4e38, -3.4e38,
            1e-45, -1e-45]  # fmt: skip


def _assert_same_as_torch(x: torch.Tensor) -> None:
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1))


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.sampled_from([1, 2, 15, 16, 17, 63, 64, 65, 1000, 2000, 3072]),
    seed=st.integers(0, 2**31 - 1),
    num_values=st.sampled_from([2, 5, None]),  # few distinct values: many ties
    special_frac=st.sampled_from([0.0, 0.02, 0.5, 1.0]),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_equals_torch_argmax(
    rows: int, width: int, seed: int, num_values: int | None, special_frac: float, dtype: type
) -> None:
    gen = np.random.default_rng(seed)
    if num_values is None:
        x = gen.standard_normal((rows, width)) * 10
    else:
        x = gen.choice(gen.standard_normal(num_values), size=(rows, width))
    x = x.astype(dtype)
    special = gen.random((rows, width)) < special_frac
    x[special] = gen.choice(np.array(SPECIALS, dtype=dtype), size=int(special.sum()))
    _assert_same_as_torch(torch.from_numpy(x))


def test_ties_nans_and_layouts() -> None:
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0],  # a tie: the lower index
                      [-0.0, 0.0, -1.0, 0.0],  # -0.0 == +0.0: the first
                      [1.0, nan, 5.0, nan],  # NaN wins, the first one
                      [-inf, -inf, -inf, -inf],  # nothing above -inf: 0
                      [inf, 7.0, inf, nan]])  # fmt: skip
    assert argmax_rows(x).tolist() == [1, 0, 1, 0, 3]
    _assert_same_as_torch(x)
    big = torch.randn(8, 3000)
    _assert_same_as_torch(big[::2])  # strided rows
    _assert_same_as_torch(big[:, 1::3])  # strided columns
    _assert_same_as_torch(big.t().contiguous().t())  # column-major
    _assert_same_as_torch(big[:0])  # no rows
    assert argmax_rows(big[:0]).shape == (0,)


def test_other_dtypes_and_grad_go_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half precision, integers, tensors that need grad and 1-D ones take torch's argmax; float
    rows on CPU take numpy's (the same answers either way, checked above)."""
    calls: list[torch.dtype] = []
    torch_argmax = torch.argmax

    def spy(x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append(x.dtype)
        return torch_argmax(x, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "argmax", spy)
    argmax_rows(torch.randn(3, 50))
    argmax_rows(torch.randn(3, 50, dtype=torch.float64))
    assert calls == []
    for x in (torch.randn(3, 50).bfloat16(), torch.randint(0, 9, (3, 50)),
              torch.randn(3, 50, requires_grad=True), torch.randn(50)):  # fmt: skip
        assert torch.equal(argmax_rows(x), torch_argmax(x, dim=-1))
    assert calls == [torch.bfloat16, torch.int64, torch.float32, torch.float32]


def test_greedy_takes_it() -> None:
    x = torch.randn(64, 5000)
    x[3, 17] = x[3, 4000] = x[3].max() + 1  # a tie
    assert torch.equal(greedy(x), torch.argmax(x, dim=-1))
    assert int(greedy(x)[3]) == 17
