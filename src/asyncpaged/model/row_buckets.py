"""Row-count buckets for the oneDNN GEMMs: a bounded set of shapes, so bounded memory.

oneDNN (and ideep, torch's layer over it) builds one primitive per distinct GEMM shape and keeps
it in two caches (``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ideep's ``LRU_CACHE_CAPACITY``, 1024
entries each); the engine's GEMMs see a new row count (the step's tokens, the rows that sample)
almost every step, and each new shape costs native memory that stays (docs/tuning.md, "Memory
and RSS"). Padding the rows of every such GEMM up to ``bucket_rows(n)`` and slicing the result
back keeps the shapes to ``len(row_buckets(limit))`` per weight shape.

Exactness: the padded rows are zeros and are dropped; each kept row is the same dot products.
oneDNN's fp32, bf16 and int8 inner products give the same bits for a row whatever the row
count (measured for the engine's shapes on AVX-512; ``tests/model/test_row_buckets.py`` checks
it on this machine), and the screened heads' bounds hold for any fp32 evaluation anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Row counts up to ``EXACT_ROWS`` run as they are; above it each octave ``(2^k, 2^(k+1)]`` has
#: ``2^MANTISSA_BITS`` buckets (steps of 2 up to 64, 4 up to 128, ... 64 up to 2048), so padding
#: adds less than 1/16 of the rows: a GEMM's cost grows about linearly with its rows from a few
#: rows on (measured: 5 -> 8 rows +70%, 17 -> 32 rows +61% on the reference model's layers).
#: Buckets up to 2048 rows: 32 + 6 x 16 = 128; each kept oneDNN primitive costs about 570 KiB
#: (its JIT code, whatever the shape), so a model's GEMM shapes x 128 bound that memory.
MANTISSA_BITS = 4
EXACT_ROWS = 2 ** (MANTISSA_BITS + 1)


def bucket_rows(num_rows: int) -> int:
    """The bucket of ``num_rows``: the smallest bucket >= it (up to ``EXACT_ROWS``, itself)."""
    if num_rows <= EXACT_ROWS:
        return max(num_rows, 0)
    step = 1 << ((num_rows - 1).bit_length() - 1 - MANTISSA_BITS)
    return -(-num_rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a GEMM of 1..``max_rows`` rows can run with, ascending."""
    return sorted({bucket_rows(n) for n in range(1, max_rows + 1)})


def bucketed(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``gemm(x)`` for x [..., in] -> [..., out], run on the rows padded to their bucket.

    ``gemm`` takes a 2-D ``[rows, in]`` tensor and returns ``[rows, out]``, row by row (a
    linear, a matmul with a fixed weight). The result is a view of the padded output's first
    rows (contiguous when ``gemm``'s output is).
    """
    if x.dim() == 2:
        return _bucketed_rows(gemm, x)
    lead = x.shape[:-1]
    out = _bucketed_rows(gemm, x.reshape(-1, x.shape[-1]))
    return out.reshape(*lead, out.shape[-1])


def _bucketed_rows(
    gemm: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor
) -> torch.Tensor:
    num_rows = rows.shape[0]
    target = bucket_rows(num_rows)
    if target == num_rows:
        return gemm(rows)
    padded = rows.new_empty((target, rows.shape[1]))
    padded[:num_rows].copy_(rows)
    padded[num_rows:].zero_()
    return gemm(padded)[:num_rows]
