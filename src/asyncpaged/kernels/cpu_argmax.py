"""Row argmax on the CPU through the native library (``csrc/argmax.cpp``), float32 or bfloat16.

``native_argmax_rows(x)`` is ``torch.argmax(x, dim=-1)`` for a 2-D CPU tensor with contiguous
rows: the first index of each row's largest value (the lowest id among ties), or of its first NaN. A
bfloat16 model's greedy rows take it on the LM head's bf16 logits, where the alternative widens
the whole [rows, vocab] block to float32 first (0.43 ms at [64 x 32000] on one thread, then
0.34 ms of numpy argmax). ``native_argmax()`` is None where the library does not build here
(callers keep theirs); ``native_argmax_rows`` then raises. ``argmax_rows`` is the same
argmax for any float32 or float64 rows through numpy's SIMD loop (torch's for the rest).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from .cpu_build import load_library
from .cpu_ops import KV_DTYPE_CODES as DTYPE_CODES  # the library's dtype codes

__all__ = ["argmax_rows", "native_argmax", "native_argmax_rows"]


class NativeArgmax:
    """The argmax of one loaded kernel library, unchecked: ``x`` [R, V] float32 or bfloat16 on
    the CPU, rows contiguous, 0 < V < 2^31."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self._argmax = lib.asyncpaged_argmax_rows
        self._argmax.restype = i32
        self._argmax.argtypes = [ptr, i32, i64, i64, i64, ptr, i32]

    def __call__(self, x: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.int64)
        threads = torch.get_num_threads() if num_threads is None else num_threads
        status = self._argmax(
            x.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], x.stride(0),
            out.data_ptr(), threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"the argmax kernel refused its inputs (status {status}).")
        return out


@functools.cache
def native_argmax(target: str | None = None) -> NativeArgmax | None:
    """The argmax of the library for ``target`` (default: the best this CPU runs), or ``None``
    when it cannot be built here."""
    lib = load_library(target)
    return None if lib is None else NativeArgmax(lib)


def native_argmax_rows(
    x: torch.Tensor, *, num_threads: int | None = None, target: str | None = None
) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of ``x`` [R, V] (float32 or bfloat16 CPU, contiguous rows,
    V > 0) -> [R] int64."""
    if x.dtype not in DTYPE_CODES or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(
            f"x must be a 2-D float32 or bfloat16 CPU tensor, got {x.dtype} {tuple(x.shape)} on "
            f"{x.device}."
        )
    if x.shape[1] == 0 or x.stride(-1) != 1:
        raise ValueError(f"x needs non-empty contiguous rows, got {tuple(x.shape)}, {x.stride()}.")
    op = native_argmax(target)
    if op is None:
        raise RuntimeError("the native CPU kernels are unavailable (no g++ or the build failed).")
    return op(x, num_threads)


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(values, dim=-1)`` of a 2-D tensor: [R, V] -> [R] int64, the first maximal
    index per row (the lowest id among ties; the first NaN where a row has one, as torch).

    On CPU, for float rows, numpy's SIMD argmax does it: torch's CPU argmax is a scalar loop,
    0.68 ms for ``[256, 2000]`` and 95 ms for ``[256, 151936]`` on one thread where numpy takes
    0.04 and 10 (docs/benchmarks.md, "Sampling, penalties")."""
    if (
        values.device.type != "cpu" or values.dtype not in (torch.float32, torch.float64)
        or values.requires_grad or values.dim() != 2 or values.shape[-1] == 0
    ):  # fmt: skip
        return torch.argmax(values, dim=-1)
    return torch.from_numpy(np.argmax(values.numpy(), axis=-1).astype(np.int64, copy=False))
