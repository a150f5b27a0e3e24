"""The native row argmax (``kernels/csrc/argmax.cpp``) against ``torch.argmax`` on float32.

Every build target the CPU runs, 1 and 2 threads, float32 and bfloat16 rows (bf16 compared
through their exact float32 widening): random rows of lengths around the vector and
four-vector widths and a vocabulary's, ties (the first index wins, -0 ties +0), rows all -inf,
NaN anywhere (the first NaN wins), and rows at a stride wider than the row.
"""

from __future__ import annotations

import pytest
import torch

from asyncpaged.kernels import cpu_build
from asyncpaged.kernels.cpu_argmax import native_argmax_rows as argmax_rows

LENGTHS = (1, 3, 15, 16, 17, 63, 64, 65, 200, 32000)
DTYPES = (torch.float32, torch.bfloat16)


def _check(x: torch.Tensor, target: str, threads: int) -> None:
    want = torch.argmax(x.float(), dim=-1)  # torch's own answer on the exact widening
    got = argmax_rows(x, num_threads=threads, target=target)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_random_rows(target: str, threads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for n in LENGTHS:
        rows = 300 if n == 32000 else 9  # 300 x 32000 takes the threaded path
        x = (torch.randn(rows, n, generator=gen) * 5).to(dtype)
        _check(x, target, threads)
        # few distinct values: many ties, the first maximal index must win
        _check(torch.randint(-3, 4, (rows, n), generator=gen).to(dtype), target, threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_ties_infinities_and_signed_zeros(target: str, dtype: torch.dtype) -> None:
    for n in (5, 64, 130):
        x = torch.full((6, n), -float("inf"))
        x[1] = 0.0
        x[1, ::2] = -0.0  # -0 first: it ties +0, so index 0 wins
        x[2, n // 2] = x[2, n - 1] = float("inf")
        x[3] = 2.5
        x[4, n - 1] = 7.0  # the last element (a tail or the last lane)
        x[5, : n // 3] = 1.0
        _check(x.to(dtype), target, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_first_nan_wins(target: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 64, 100, 1000):
        for where in {0, n // 3, n - 1}:
            x = torch.randn(3, n, generator=gen)
            x[0, where] = float("nan")
            x[1, where:] = float("nan")
            x[2, where] = -float("nan")
            x[2, 0] = 1e30  # a larger number before it does not hide it
            _check(x.to(dtype), target, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_strided_rows(target: str, dtype: torch.dtype) -> None:
    wide = torch.randn(40, 100, generator=torch.Generator().manual_seed(2)).to(dtype)
    wide[:, 77:] = 100.0  # past the rows' end: must not be read
    _check(wide[:, 3:77], target, 2)


def test_inputs_are_checked() -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        argmax_rows(torch.randn(2, 3).double())
    with pytest.raises(ValueError, match="2-D"):
        argmax_rows(torch.randn(6))
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax_rows(torch.randn(4, 3).t())
    with pytest.raises(ValueError, match="non-empty"):
        argmax_rows(torch.empty(3, 0))
