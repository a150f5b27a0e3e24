"""Matmul with quantized weights in Triton (CUDA): the GGUF block types of ``quant_matmul`` and
the int4 / int8 / fp8 codes of ``scaled_matmul``, read in their stored layout.

``triton_quant_matmul(x, w, qtype, k)`` is ``quant_matmul``'s product and
``triton_scaled_matmul(x, w, layout)`` is ``scaled_matmul``'s: ``x`` [M, K] float32, ``w`` the
same uint8 rows the CPU kernels read (N rows of GGUF blocks, or of codes), ``y`` [M, N] float32.
Each program decodes a ``[BLOCK_N, BLOCK_K]`` tile of W from its bytes in registers into exactly
the float32 values ``dequantize_rows`` / ``dequantize_codes`` give (the same float32 operations
in the same order; W is never written out) and sums in float32, so the result meets the CPU
kernels' bound: ``|y - y_exact| <= K * 2**-23 * (|x| @ |W|.T)``.

Two paths, by the number of rows of x:

* ``M <= GEMV_MAX_ROWS`` (decode): each program owns ``BLOCK_N`` output columns for all rows,
  decodes each W tile once and reduces ``x[:, None, :] * w[None, :, :]`` over K in float32.
* more rows (prefill): ``[BLOCK_M, BLOCK_N]`` output tiles, ``tl.dot`` of the x tile with the
  decoded W tile in IEEE float32 (never TF32, which would break the bound).

Where a decode needs care:

* GGUF fp16 scales are read through a float16 view of the same bytes (every block size and
  every scale offset is even).
* fp8 e4m3fn codes are decoded with integer operations (normal, subnormal, NaN), not with a
  float8 cast, so the interpreter and the GPU agree bit for bit.
* Rounding a weight to bfloat16 / float16 scales (compressed-tensors computes ``(q - z) * s`` in
  the scale's dtype) is done by hand for bfloat16 (round to nearest even on the bits: the
  interpreter truncates in a cast) and through a clamped cast for float16 (overflow to inf made
  explicit: numpy warns on an overflowing cast).

``triton_dequantize_rows`` / ``triton_dequantize_codes`` write the decoded rows (a token
embedding's lookup on CUDA; the tests' bit-for-bit check of the decode). Under
``TRITON_INTERPRET=1`` everything runs on CPU tensors (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
import triton
import triton.language as tl

from .quant_matmul import QTYPES, QuantType, describe_tensor, quant_type, row_bytes
from .scaled_matmul import CODES, ROUNDINGS, RUN, ScaledLayout

__all__ = [
    "GEMV_MAX_ROWS",
    "triton_dequantize_codes",
    "triton_dequantize_rows",
    "triton_quant_matmul",
    "triton_scaled_matmul",
]

GEMV_MAX_ROWS: Final = 8  # rows of x up to which the GEMV path runs
#: GGUF type name -> the kernels' QTYPE id
_QTYPE_IDS: Final = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
#: code name -> the kernels' CODE id
_CODE_IDS: Final = {"int8": 0, "int4": 1, "fp8_e4m3": 2}
_DEQUANT_BLOCK_N: Final = 16
_DEQUANT_BLOCK_K: Final = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class MatmulTiles:
    """Tile sizes and warps of one launch (``tiles_for``)."""

    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int


def tiles_for(num_rows: int, k: int) -> MatmulTiles:
    """The launch for ``num_rows`` rows of x and ``k`` columns (a multiple of 32): GEMV tiles up
    to ``GEMV_MAX_ROWS`` rows, ``tl.dot`` tiles above."""
    if num_rows <= GEMV_MAX_ROWS:
        block_m = triton.next_power_of_2(max(num_rows, 1))
        block_k = 64 if k % 64 == 0 and block_m <= 2 else 32
        return MatmulTiles(block_m=block_m, block_n=64 // max(block_m // 2, 1), block_k=block_k,
                           use_dot=False, num_warps=4)  # fmt: skip
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    return MatmulTiles(block_m=block_m, block_n=64, block_k=32, use_dot=True, num_warps=4)


# ---------------------------------------------------------------------------------------------
# Decoding: each function maps a broadcastable pair (row byte offsets, element indices) to the
# float32 weights, zero where ``mask`` is false. ``row`` is int64 (row * row_bytes can pass
# 2**31 for a large embedding); ``k`` is the element's index in its row.


@triton.jit
def _byte(w_ptr, offset, mask):  # type: ignore[no-untyped-def]
    return tl.load(w_ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(wh_ptr, offset, mask):  # type: ignore[no-untyped-def]
    """The fp16 at byte ``offset`` (even) as float32."""
    return tl.load(wh_ptr + offset // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _signed(b):  # type: ignore[no-untyped-def]
    """A byte (int32 0..255) as int8's value."""
    return (b ^ 128) - 128


@triton.jit
def _decode_q8_0(w_ptr, wh_ptr, row, k, mask):  # type: ignore[no-untyped-def]
    base = row + (k // 32) * 34
    d = _half(wh_ptr, base, mask)
    q = _signed(_byte(w_ptr, base + 2 + k % 32, mask))
    return d * q.to(tl.float32)


@triton.jit
def _decode_q4_0(w_ptr, wh_ptr, row, k, mask):  # type: ignore[no-untyped-def]
    base = row + (k // 32) * 18
    j = k % 32
    d = _half(wh_ptr, base, mask)
    q = (_byte(w_ptr, base + 2 + j % 16, mask) >> (4 * (j // 16))) & 15
    return d * (q - 8).to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_qk_45(w_ptr, wh_ptr, row, k, mask, HIGH_BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Q4_K (144-byte blocks) and Q5_K (176: 32 bytes of fifth bits before the nibbles)."""
    base = row + (k // 256) * (144 + 32 * HIGH_BITS)
    e = k % 256
    c = e // 32  # sub-block: its 6-bit scale and min
    lane = e % 32
    d = _half(wh_ptr, base, mask)
    dmin = _half(wh_ptr, base + 2, mask)
    a = _byte(w_ptr, base + 4 + c, mask)
    b = _byte(w_ptr, base + 8 + c, mask)
    low_half = c < 4
    prev = _byte(w_ptr, base + 4 + tl.where(low_half, c, c - 4), mask)
    sc = tl.where(low_half, a & 63, (b & 15) | ((prev >> 6) << 4))
    mn = tl.where(low_half, b & 63, (b >> 4) | ((a >> 6) << 4))
    q = (
        _byte(w_ptr, base + 16 + 32 * HIGH_BITS + 32 * (c // 2) + lane, mask) >> (4 * (c % 2))
    ) & 15
    if HIGH_BITS:
        q = q | (((_byte(w_ptr, base + 16 + lane, mask) >> c) & 1) << 4)
    dl = d * sc.to(tl.float32)
    ml = dmin * mn.to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _decode_q6_k(w_ptr, wh_ptr, row, k, mask):  # type: ignore[no-untyped-def]
    base = row + (k // 256) * 210
    e = k % 256
    half = e // 128
    r = e % 128
    ql = (_byte(w_ptr, base + 64 * half + r % 64, mask) >> (4 * (r // 64))) & 15
    qh = (_byte(w_ptr, base + 128 + 32 * half + r % 32, mask) >> (2 * (r // 32))) & 3
    q = (ql | (qh << 4)) - 32
    sc = _signed(_byte(w_ptr, base + 192 + e // 16, mask))
    d = _half(wh_ptr, base + 208, mask)
    return (d * sc.to(tl.float32)) * q.to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_gguf(w_ptr, wh_ptr, row, k, mask, QTYPE: tl.constexpr):  # type: ignore[no-untyped-def]
    if QTYPE == 0:
        w = _decode_q8_0(w_ptr, wh_ptr, row, k, mask)
    elif QTYPE == 1:
        w = _decode_q4_0(w_ptr, wh_ptr, row, k, mask)
    elif QTYPE == 2:
        w = _decode_qk_45(w_ptr, wh_ptr, row, k, mask, False)
    elif QTYPE == 3:
        w = _decode_qk_45(w_ptr, wh_ptr, row, k, mask, True)
    else:
        w = _decode_q6_k(w_ptr, wh_ptr, row, k, mask)
    return w


@triton.jit
def _fp8_e4m3fn(b):  # type: ignore[no-untyped-def]
    """A byte (int32) as the float8 e4m3fn value it holds, in float32 (0x7f / 0xff: NaN)."""
    sign = (b >> 7).to(tl.uint32)
    exponent = (b >> 3) & 15
    mantissa = b & 7
    bits = (sign << 31) | ((exponent + 120).to(tl.uint32) << 23) | (mantissa.to(tl.uint32) << 20)
    bits = tl.where((b & 127) == 127, (sign << 31) | 0x7FC00000, bits)
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _is_nan(w):  # type: ignore[no-untyped-def]
    return (w.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000


@triton.jit
def _round_bf16(w):  # type: ignore[no-untyped-def]
    """float32 -> the nearest bfloat16 (ties to even), as float32; NaN stays NaN."""
    bits = w.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(_is_nan(w), w, bits.to(tl.float32, bitcast=True))


@triton.jit
def _round_fp16(w):  # type: ignore[no-untyped-def]
    """float32 -> the nearest float16 (ties to even), as float32: inf from 65520 on; NaN stays
    NaN. The cast sees only finite float16 values."""
    clamped = tl.minimum(tl.maximum(w, -65504.0), 65504.0)
    r = clamped.to(tl.float16).to(tl.float32)
    inf = ((w.to(tl.uint32, bitcast=True) & 0x80000000) | 0x7F800000).to(tl.float32, bitcast=True)
    r = tl.where(tl.abs(w) >= 65520.0, inf, r)
    return tl.where(_is_nan(w), w, r)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_codes(  # type: ignore[no-untyped-def]
    w_ptr, scales_ptr, zeros_ptr, n, k, mask, row_bytes, num_groups, group_size, row_block,
    CODE: tl.constexpr, HAS_ZEROS: tl.constexpr, ROUNDING: tl.constexpr,
):  # fmt: skip
    """``n`` (int64 row indices) and ``k`` broadcast: compressed-tensors' ``(q - z) * s`` or
    ``f * s`` in float32, rounded to the scale's dtype (ROUNDING 1: bfloat16, 2: float16)."""
    row = n * row_bytes
    if CODE == 1:  # int4: byte j of a run of 32 holds codes j (low) and 16 + j (high)
        j = k % 32
        b = _byte(w_ptr, row + (k // 32) * 16 + j % 16, mask)
        code = (b >> (4 * (j // 16))) & 15
    else:
        code = _byte(w_ptr, row + k, mask)
    at = (n // row_block) * num_groups + k // group_size
    s = tl.load(scales_ptr + at, mask=mask, other=0.0)
    if CODE == 2:
        w = _fp8_e4m3fn(code) * s
    elif HAS_ZEROS:
        z = tl.load(zeros_ptr + at, mask=mask, other=0.0)
        w = (code.to(tl.float32) - z) * s
    elif CODE == 0:
        w = (code.to(tl.float32) - 128.0) * s
    else:
        w = (code.to(tl.float32) - 8.0) * s
    if ROUNDING == 1:
        w = _round_bf16(w)
    elif ROUNDING == 2:
        w = _round_fp16(w)
    return w


# ---------------------------------------------------------------------------------------------
# The products and the dequantizations


@triton.jit  # type: ignore[untyped-decorator]
def _accumulate(acc, x_ptr, stride_xm, offs_m, m_mask, k, w_tile, USE_DOT: tl.constexpr):  # type: ignore[no-untyped-def]
    """acc [BM, BN] + x[offs_m, k] @ W-tile; ``w_tile`` is [BK, BN] with USE_DOT, else
    [BN, BK]."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
    if USE_DOT:
        acc += tl.dot(x, w_tile, input_precision="ieee")
    else:
        acc += tl.sum(x[:, None, :] * w_tile[None, :, :], axis=2)
    return acc


@triton.jit(do_not_specialize=["num_rows"])  # type: ignore[untyped-decorator]
def _gguf_matmul_kernel(  # type: ignore[no-untyped-def]
    y_ptr,  # [M, N] float32
    x_ptr,  # [M, K] float32 (rows stride_xm apart)
    w_ptr,  # [N, row_bytes] uint8
    wh_ptr,  # the same bytes as float16
    num_rows,
    num_cols,
    stride_xm,
    stride_ym,
    K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < num_cols
    m_mask = offs_m < num_rows
    row = offs_n.to(tl.int64) * ROW_BYTES
    offs_m64 = offs_m.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if USE_DOT:  # [BK, BN]
            w = _decode_gguf(w_ptr, wh_ptr, row[None, :], k[:, None], n_mask[None, :], QTYPE)
        else:  # [BN, BK]
            w = _decode_gguf(w_ptr, wh_ptr, row[:, None], k[None, :], n_mask[:, None], QTYPE)
        acc = _accumulate(acc, x_ptr, stride_xm, offs_m64, m_mask, k, w, USE_DOT)
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])  # type: ignore[untyped-decorator]
def _scaled_matmul_kernel(  # type: ignore[no-untyped-def]
    y_ptr,  # [M, N] float32
    x_ptr,  # [M, K] float32 (rows stride_xm apart)
    w_ptr,  # [N, row_bytes] uint8
    scales_ptr,  # [ceil(N / row_block), num_groups] float32
    zeros_ptr,  # same shape (HAS_ZEROS), else any pointer
    num_rows,
    num_cols,
    stride_xm,
    stride_ym,
    num_groups,
    group_size,
    row_block,
    K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    CODE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ROUNDING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < num_cols
    m_mask = offs_m < num_rows
    n64 = offs_n.to(tl.int64)
    offs_m64 = offs_m.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if USE_DOT:  # [BK, BN]
            w = _decode_codes(w_ptr, scales_ptr, zeros_ptr, n64[None, :], k[:, None],
                              n_mask[None, :], ROW_BYTES, num_groups, group_size, row_block,
                              CODE, HAS_ZEROS, ROUNDING)  # fmt: skip
        else:  # [BN, BK]
            w = _decode_codes(w_ptr, scales_ptr, zeros_ptr, n64[:, None], k[None, :],
                              n_mask[:, None], ROW_BYTES, num_groups, group_size, row_block,
                              CODE, HAS_ZEROS, ROUNDING)  # fmt: skip
        acc = _accumulate(acc, x_ptr, stride_xm, offs_m64, m_mask, k, w, USE_DOT)
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit  # type: ignore[untyped-decorator]
def _gguf_dequantize_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [N, K] float32
    w_ptr,
    wh_ptr,
    num_cols,
    K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n[:, None] < num_cols
    n64 = offs_n.to(tl.int64)[:, None]
    w = _decode_gguf(w_ptr, wh_ptr, n64 * ROW_BYTES, k[None, :], n_mask, QTYPE)
    tl.store(out_ptr + n64 * K + k[None, :], w, mask=n_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _codes_dequantize_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [N, K] float32
    w_ptr,
    scales_ptr,
    zeros_ptr,
    num_cols,
    num_groups,
    group_size,
    row_block,
    K: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    CODE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ROUNDING: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n[:, None] < num_cols
    n64 = offs_n.to(tl.int64)[:, None]
    w = _decode_codes(w_ptr, scales_ptr, zeros_ptr, n64, k[None, :], n_mask, ROW_BYTES,
                      num_groups, group_size, row_block, CODE, HAS_ZEROS, ROUNDING)  # fmt: skip
    tl.store(out_ptr + n64 * K + k[None, :], w, mask=n_mask)


# ---------------------------------------------------------------------------------------------
# Host side


def _check_gguf_weight(w: torch.Tensor, qtype: str, k: int) -> QuantType:
    """``w`` must be a contiguous uint8 tensor [N, row_bytes(qtype, k)] (any device)."""
    q = quant_type(qtype)
    want = row_bytes(qtype, k)
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8:
        raise ValueError(f"w must be a uint8 tensor, got {describe_tensor(w)}.")
    if w.dim() != 2 or w.shape[1] != want or not w.is_contiguous():
        raise ValueError(
            f"w must be contiguous [N, {want}] ({k} {q.name} elements per row), got "
            f"{tuple(w.shape)} strides {w.stride()}."
        )
    return q


def _check_input(x: torch.Tensor, k: int, device: torch.device) -> None:
    """``x`` must be a float32 tensor [M, k] on ``device`` with contiguous rows."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device != device:
        raise ValueError(f"x must be a float32 tensor on {device}, got {describe_tensor(x)}.")
    if x.dim() != 2 or x.shape[1] != k or (k > 1 and x.stride(1) != 1):
        raise ValueError(
            f"x must be [M, {k}] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}."
        )


def _check_codes(w: torch.Tensor, layout: ScaledLayout) -> None:
    """``w`` and ``layout`` must agree (``scaled_matmul.check_layout``'s rules, any device)."""
    if layout.code not in CODES:
        raise ValueError(f"code must be one of {sorted(CODES)}, got {layout.code!r}.")
    k = layout.in_features
    if not isinstance(k, int) or k <= 0 or k % RUN != 0:
        raise ValueError(f"in_features must be a positive multiple of {RUN}, got {k!r}.")
    if not isinstance(layout.group_size, int) or layout.group_size < RUN:
        raise ValueError(f"group_size must be an int >= {RUN}, got {layout.group_size!r}.")
    if layout.scale_dtype not in ROUNDINGS:
        raise ValueError(f"scale_dtype must be one of {list(ROUNDINGS)}, got {layout.scale_dtype}.")
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8:
        raise ValueError(f"w must be a uint8 tensor, got {describe_tensor(w)}.")
    if w.dim() != 2 or w.shape[1] != layout.row_bytes or not w.is_contiguous():
        raise ValueError(
            f"w must be contiguous [N, {layout.row_bytes}] ({k} {layout.code} codes per row), "
            f"got {tuple(w.shape)} strides {w.stride()}."
        )
    if not isinstance(layout.row_block, int) or layout.row_block < 1:
        raise ValueError(f"row_block must be a positive int, got {layout.row_block!r}.")
    want = (-(-int(w.shape[0]) // layout.row_block), layout.num_groups)
    for name, t in (("scales", layout.scales), ("zeros", layout.zeros)):
        if t is None:
            continue
        if t.dtype != torch.float32 or t.device != w.device or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous float32 tensor on {w.device}, got "
                f"{describe_tensor(t)}."
            )
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}.")
    if layout.zeros is not None and layout.code == "fp8_e4m3":
        raise ValueError("fp8 codes have no zero points: zeros must be None.")


def _code_args(layout: ScaledLayout) -> dict[str, int | bool]:
    return {
        "K": layout.in_features,
        "ROW_BYTES": layout.row_bytes,
        "CODE": _CODE_IDS[layout.code],
        "HAS_ZEROS": layout.zeros is not None,
        "ROUNDING": ROUNDINGS[layout.scale_dtype],
    }


def _dequant_block_k(k: int) -> int:
    block = _DEQUANT_BLOCK_K
    while k % block:
        block //= 2
    return block


def triton_quant_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``x @ dequantize_rows(w, qtype, k).T`` in Triton: x [M, k] float32 (rows contiguous),
    w [N, row_bytes(qtype, k)] uint8 contiguous, on one device -> [M, N] float32 (exact up to
    float32 summation order). ``ValueError`` on inconsistent input, before any launch."""
    q = _check_gguf_weight(w, qtype, k)
    _check_input(x, k, w.device)
    num_rows, num_cols = int(x.shape[0]), int(w.shape[0])
    y = torch.empty(num_rows, num_cols, dtype=torch.float32, device=w.device)
    if num_rows == 0 or num_cols == 0:
        return y
    tiles = tiles_for(num_rows, k)
    grid = (triton.cdiv(num_cols, tiles.block_n), triton.cdiv(num_rows, tiles.block_m))
    _gguf_matmul_kernel[grid](
        y, x, w, w.view(torch.float16), num_rows, num_cols, x.stride(0), y.stride(0),
        K=k, ROW_BYTES=w.shape[1], QTYPE=_QTYPE_IDS[q.name], BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, USE_DOT=tiles.use_dot,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return y


def triton_dequantize_rows(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """w [N, row_bytes(qtype, k)] uint8 -> [N, k] float32 on w's device, bit for bit
    ``dequantize_rows``."""
    q = _check_gguf_weight(w, qtype, k)
    num_cols = int(w.shape[0])
    out = torch.empty(num_cols, k, dtype=torch.float32, device=w.device)
    if num_cols == 0:
        return out
    block_k = _dequant_block_k(k)
    grid = (triton.cdiv(num_cols, _DEQUANT_BLOCK_N), k // block_k)
    _gguf_dequantize_kernel[grid](
        out, w, w.view(torch.float16), num_cols, K=k, ROW_BYTES=w.shape[1],
        QTYPE=_QTYPE_IDS[q.name], BLOCK_N=_DEQUANT_BLOCK_N, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def triton_scaled_matmul(x: torch.Tensor, w: torch.Tensor, layout: ScaledLayout) -> torch.Tensor:
    """``x @ dequantize_codes(w, layout).T`` in Triton: x [M, K] float32 (rows contiguous),
    w [N, layout.row_bytes] uint8 contiguous, the layout's scales (and zeros) on w's device ->
    [M, N] float32 (exact up to float32 summation order). ``ValueError`` on inconsistent
    input, before any launch."""
    _check_codes(w, layout)
    k = layout.in_features
    _check_input(x, k, w.device)
    num_rows, num_cols = int(x.shape[0]), int(w.shape[0])
    y = torch.empty(num_rows, num_cols, dtype=torch.float32, device=w.device)
    if num_rows == 0 or num_cols == 0:
        return y
    tiles = tiles_for(num_rows, k)
    grid = (triton.cdiv(num_cols, tiles.block_n), triton.cdiv(num_rows, tiles.block_m))
    zeros = layout.scales if layout.zeros is None else layout.zeros
    _scaled_matmul_kernel[grid](
        y, x, w, layout.scales, zeros, num_rows, num_cols, x.stride(0), y.stride(0),
        layout.num_groups, min(layout.group_size, k), layout.row_block, **_code_args(layout),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        USE_DOT=tiles.use_dot, num_warps=tiles.num_warps,
    )  # fmt: skip
    return y


def triton_dequantize_codes(w: torch.Tensor, layout: ScaledLayout) -> torch.Tensor:
    """w [N, layout.row_bytes] uint8 -> [N, K] float32 on w's device, bit for bit
    ``dequantize_codes``."""
    _check_codes(w, layout)
    k = layout.in_features
    num_cols = int(w.shape[0])
    out = torch.empty(num_cols, k, dtype=torch.float32, device=w.device)
    if num_cols == 0:
        return out
    block_k = _dequant_block_k(k)
    grid = (triton.cdiv(num_cols, _DEQUANT_BLOCK_N), k // block_k)
    zeros = layout.scales if layout.zeros is None else layout.zeros
    _codes_dequantize_kernel[grid](
        out, w, layout.scales, zeros, num_cols, layout.num_groups, min(layout.group_size, k),
        layout.row_block, **_code_args(layout), BLOCK_N=_DEQUANT_BLOCK_N, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip
    return out


assert set(_QTYPE_IDS) == set(QTYPES), "a GGUF type without a Triton decode"
assert set(_CODE_IDS) == set(CODES), "a code without a Triton decode"
