"""``stable_sort_rows`` is ``torch.sort(..., stable=True)``: the same values and the same order,
ties by index, on rows with ties, signed zeros, infinities and NaNs; and top-p sampling
through it keeps exactly the tokens the torch sort keeps; and the CPU float32 top-p, which sorts
the values alone, gives the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.sampling import logits as logits_processors
from asyncpaged.sampling.logits import apply_top_k_top_p, stable_sort_rows

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1.0, -1.0,
            3.4e38, -3.4e38, 1e-45, -1e-45]  # fmt: skip


def _assert_same_as_torch(x: torch.Tensor) -> None:
    want_values, want_order = torch.sort(x, dim=-1, stable=True)
    values, order = stable_sort_rows(x)
    assert torch.equal(order, want_order)
    assert torch.equal(values.isnan(), want_values.isnan())
    assert torch.equal(values.nan_to_num(), want_values.nan_to_num())
    # bit for bit: the values are the inputs' own (a -0.0 stays -0.0)
    assert torch.equal(values.view(torch.int32), x.gather(1, want_order).view(torch.int32))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    width=st.sampled_from([700, 1024, 2000, 4097]),
    seed=st.integers(0, 2**31 - 1),
    num_values=st.sampled_from([3, 50, None]),  # few distinct values: many ties
    special_frac=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_equals_torch_stable_sort(
    rows: int, width: int, seed: int, num_values: int | None, special_frac: float
) -> None:
    gen = np.random.default_rng(seed)
    if num_values is None:
        x = gen.standard_normal((rows, width)).astype(np.float32) * 10
    else:
        x = gen.choice(gen.standard_normal(num_values).astype(np.float32), size=(rows, width))
    special = gen.random((rows, width)) < special_frac
    x[special] = gen.choice(np.array(SPECIALS, dtype=np.float32), size=int(special.sum()))
    _assert_same_as_torch(torch.from_numpy(x))


def test_the_keyed_path_runs_where_it_should(monkeypatch: pytest.MonkeyPatch) -> None:
    """Big float32 CPU rows take the key; small ones and other dtypes go to torch's sort (the
    same answer either way, checked above)."""
    calls: list[torch.dtype] = []
    torch_sort = torch.sort

    def spy(x: torch.Tensor, **kwargs: object) -> object:
        calls.append(x.dtype)
        return torch_sort(x, **kwargs)  # type: ignore[call-overload]

    x = torch.randn(4, 2000)
    want = torch_sort(x, dim=-1, stable=True).indices
    monkeypatch.setattr(torch, "sort", spy)
    assert torch.equal(stable_sort_rows(x)[1], want)
    assert calls == [], "a [4, 2000] float32 row set should take the keyed sort"
    stable_sort_rows(torch.randn(2, 16))
    values, order = stable_sort_rows(x.double())
    assert calls == [torch.float32, torch.float64]
    assert torch.equal(order, want) and values.dtype == torch.float64


def test_non_contiguous_rows() -> None:
    x = torch.randn(2000, 6).t()  # [6, 2000], strided
    _assert_same_as_torch(x)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_keeps_the_tokens_the_torch_sort_keeps(
    top_p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The three ways give the same bits: from the sorted values alone (the CPU float32 path),
    through the keyed sort with the order, and through torch's stable sort."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(32, 3000, generator=gen) * 3
    logits[:, :500] = logits[:, 500:1000]  # ties across the top-p boundary
    logits[3, :] = 0.0  # a flat row
    logits[5, ::2] = -0.0  # signed zeros tied with zeros
    p = torch.full((32,), top_p)
    k = torch.full((32,), 3000, dtype=torch.int64)
    k[::3] = 40
    by_values = apply_top_k_top_p(logits, k, p)
    keyed = logits_processors._top_k_top_p_sorted(logits, k, p)
    monkeypatch.setattr(logits_processors, "stable_sort_rows",
                        lambda x: torch.sort(x, dim=-1, stable=True))  # fmt: skip
    want = logits_processors._top_k_top_p_sorted(logits, k, p)
    assert torch.equal(keyed, want)
    assert torch.equal(by_values, want)
    assert torch.equal(apply_top_k_top_p(logits, None, p),
                       logits_processors._top_k_top_p_sorted(logits, None, p))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    width=st.integers(1, 24),
    with_top_k=st.booleans(),
)
def test_top_p_from_sorted_values_is_the_sorted_way_bit_for_bit(
    data: st.DataObject, width: int, with_top_k: bool
) -> None:
    """Rows of few distinct values (ties everywhere, across the top-k and top-p boundaries),
    signed zeros, infinities and NaN; the same bits as sorting with the order (torch.equal,
    NaN where NaN)."""
    values = st.sampled_from([0.0, -0.0, 1.0, 2.5, -3.0, 0.3, 7.0, -float("inf"), float("inf"),
                              float("nan")])  # fmt: skip
    rows = data.draw(st.lists(st.lists(values, min_size=width, max_size=width), min_size=1,
                              max_size=5))  # fmt: skip
    logits = torch.tensor(rows, dtype=torch.float32)
    ps = data.draw(st.lists(st.sampled_from([1e-9, 0.1, 0.5, 0.77, 0.9, 0.999, 1.0]),
                            min_size=len(rows), max_size=len(rows)))  # fmt: skip
    top_p = torch.tensor(ps)
    top_k = None
    if with_top_k:
        ks = data.draw(st.lists(st.integers(1, width), min_size=len(rows), max_size=len(rows)))
        top_k = torch.tensor(ks)
    got = apply_top_k_top_p(logits, top_k, top_p)
    want = logits_processors._top_k_top_p_sorted(logits, top_k, top_p)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    numbers = ~want.isnan()  # zeros keep their signs, as the sorted way's gather keeps them
    assert torch.equal(torch.signbit(got)[numbers], torch.signbit(want)[numbers])
