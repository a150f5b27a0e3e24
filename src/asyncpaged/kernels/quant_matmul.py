"""Matmul with GGUF-quantized weights kept in their block layout (``csrc/quant_matmul.cpp``).

``quant_matmul(x, w, qtype, k)`` is ``x @ dequantize_rows(w, qtype, k).T``: ``x`` [M, K] float32,
``w`` [N, row_bytes] uint8 holding N rows of raw GGUF blocks of ``qtype`` (``QTYPES``), ``y``
[M, N] float32. The native kernel dequantizes each block in registers (the matrix is never
dequantized) to exactly the float32 values gguf-py's ``dequantize`` gives, and sums in float32,
so it differs from ``x @ dequantize(w).T`` in float32 only by summation order:
``|y - y_exact| <= K * eps * (|x| @ |W|.T)`` with ``eps = 2**-23`` (twice the unit roundoff, the
bound of any summation order). Few rows (decode) take a GEMV that decodes each block once for all
rows; more rows (prefill) decode a W tile once into an L1 buffer and run every row over it.

Without the native library (no g++, or its build failed) ``quant_matmul`` falls back to
``torch_quant_matmul``: the same result through ``dequantize_rows`` of a few hundred rows at a
time and a float32 matmul.

``activations="int8"`` (opt-in, llama.cpp's way) quantizes each row of x per block of the
weight type (32 elements for Q8_0 / Q4_0, 256 for the K-quants): ``dx = max|x| / 127`` in
float32 and ``q = round_half_even(x * (1 / dx))`` (``quantize_activations``); each block's dot
product with the weights' integer codes is then an exact int32 sum and only the per-block
scaling and the sum over blocks round in float32. So it computes ``(dx * q) @ dequantize(W).T``
up to float32 rounding of that combination (``torch_quant_matmul_int8`` is the float64
reference); the difference from the exact float32 path is the quantization of x (relative error
~1e-2 on random data). Few rows (decode: up to 3-8 by type, in the avx2 and avx512 builds) take
a kernel that streams each row of W once and decodes its blocks in registers straight into
integer dot products (``vpdpbusd`` / ``vpdpwssd`` with AVX512-VNNI, ``pmaddubsw`` + ``pmaddwd``
otherwise), near memory bandwidth at one row; more rows decode a group of rows of W once per K
chunk into an interleaved buffer that every row of x reuses.

::

    QTYPE  elements/block  bytes/block
    Q4_0   32              18   (d fp16, 16 B of nibbles: q - 8)
    Q8_0   32              34   (d fp16, 32 int8)
    Q4_K   256             144  (d, dmin fp16, 12 B of 6-bit scales/mins, 128 B of nibbles)
    Q5_K   256             176  (as Q4_K plus 32 B of fifth bits)
    Q6_K   256             210  (128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales, d)
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch

from .cpu_build import load_library

__all__ = [
    "QTYPES",
    "QuantType",
    "dequantize_rows",
    "native_quant_matmul",
    "quant_matmul",
    "quantize_activations",
    "row_bytes",
    "torch_quant_matmul",
    "torch_quant_matmul_int8",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantType:
    """A GGML block type: its GGML type id, elements and bytes per block."""

    name: str
    ggml_type: int
    block_elems: int
    block_bytes: int


QTYPES: Final = {
    q.name: q
    for q in (
        QuantType(name="Q4_0", ggml_type=2, block_elems=32, block_bytes=18),
        QuantType(name="Q8_0", ggml_type=8, block_elems=32, block_bytes=34),
        QuantType(name="Q4_K", ggml_type=12, block_elems=256, block_bytes=144),
        QuantType(name="Q5_K", ggml_type=13, block_elems=256, block_bytes=176),
        QuantType(name="Q6_K", ggml_type=14, block_elems=256, block_bytes=210),
    )
}
PATHS: Final = {"auto": 0, "gemv": 1, "tiled": 2}
ACTIVATIONS: Final = ("float32", "int8")
FALLBACK_ROWS: Final = 256  # rows of W dequantized at a time by the torch fallback
_STATUS_MESSAGES: Final = {
    6: "unknown quantization type",
    7: "inconsistent sizes or path",
    8: "out of memory for the packed or quantized copy of x",
}


def quant_type(qtype: str) -> QuantType:
    """The ``QuantType`` named ``qtype`` (``ValueError`` if unsupported)."""
    if not isinstance(qtype, str) or qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {sorted(QTYPES)}, got {qtype!r}.")
    return QTYPES[qtype]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of ``k`` elements of ``qtype`` (``k`` a positive multiple of its block)."""
    q = quant_type(qtype)
    if not isinstance(k, int) or k <= 0 or k % q.block_elems != 0:
        raise ValueError(
            f"k must be a positive multiple of {q.name}'s block of {q.block_elems}, got {k!r}."
        )
    return k // q.block_elems * q.block_bytes


def check_weight(w: torch.Tensor, qtype: str, k: int) -> QuantType:
    """``w`` must be a contiguous uint8 CPU tensor [N, row_bytes(qtype, k)]."""
    q = quant_type(qtype)
    want = row_bytes(qtype, k)
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.device.type != "cpu":
        raise ValueError(f"w must be a uint8 CPU tensor, got {describe_tensor(w)}.")
    if w.dim() != 2 or w.shape[1] != want or not w.is_contiguous():
        raise ValueError(
            f"w must be contiguous [N, {want}] ({k} {q.name} elements per row), got "
            f"{tuple(w.shape)} strides {w.stride()}."
        )
    return q


def check_input(x: torch.Tensor, k: int) -> None:
    """``x`` must be a contiguous float32 CPU tensor [M, k]."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor, got {describe_tensor(x)}.")
    if x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(
            f"x must be contiguous [M, {k}], got {tuple(x.shape)} strides {x.stride()}."
        )


def describe_tensor(t: object) -> str:
    """A tensor's dtype, shape and device (else its type), for error messages."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


class NativeQuantMatmul:
    """The quantized matmul of one loaded kernel library, unchecked (``quant_matmul`` checks)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self._matmul = lib.asyncpaged_quant_matmul
        self._matmul.restype = i32
        self._matmul.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, ptr, i32, i32]
        self._matmul_int8 = lib.asyncpaged_quant_matmul_int8
        self._matmul_int8.restype = i32
        self._matmul_int8.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, ptr, i32, i32]
        self._quantize = lib.asyncpaged_quantize_activations
        self._quantize.restype = i32
        self._quantize.argtypes = [ptr, i64, i64, i32, ptr, ptr]

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, q: QuantType, k: int, path: str, num_threads: int
    ) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        status = self._matmul(
            x.data_ptr(), x.shape[0], k, w.data_ptr(), w.shape[0], w.shape[1], q.ggml_type,
            y.data_ptr(), PATHS[path], num_threads,
        )  # fmt: skip
        _check_status(status)
        return y

    def int8(
        self, x: torch.Tensor, w: torch.Tensor, q: QuantType, k: int, num_threads: int,
        vnni: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The int8-activation product; ``vnni``: ``None`` where the CPU has AVX512-VNNI,
        ``False`` never, ``True`` always (``ValueError`` where the CPU or build lacks it)."""
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        status = self._matmul_int8(
            x.data_ptr(), x.shape[0], k, w.data_ptr(), w.shape[0], w.shape[1], q.ggml_type,
            y.data_ptr(), -1 if vnni is None else int(vnni), num_threads,
        )  # fmt: skip
        _check_status(status)
        return y

    def quantize(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32 -> (q [M, K] int16, dx [M, K // block] float32)."""
        q = torch.empty(x.shape, dtype=torch.int16)
        dx = torch.empty(x.shape[0], x.shape[1] // block, dtype=torch.float32)
        status = self._quantize(
            x.data_ptr(), x.shape[0], x.shape[1], block, q.data_ptr(), dx.data_ptr()
        )
        _check_status(status)
        return q, dx


def _check_status(status: int) -> None:
    if status != 0:
        message = _STATUS_MESSAGES.get(status, str(status))
        raise ValueError(f"the quantized matmul kernel refused its inputs: {message}.")


@functools.cache
def native_quant_matmul(target: str | None = None) -> NativeQuantMatmul | None:
    """The kernel of the library for ``target`` (default: the best this CPU runs), or ``None``
    when it cannot be built here."""
    lib = load_library(target)
    return None if lib is None else NativeQuantMatmul(lib)


def quant_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    qtype: str,
    k: int,
    *,
    num_threads: int | None = None,
    target: str | None = None,
    path: str = "auto",
    activations: str = "float32",
) -> torch.Tensor:
    """``x @ dequantize_rows(w, qtype, k).T``: x [M, k] float32, w [N, row_bytes(qtype, k)]
    uint8, both contiguous on the CPU -> [M, N] float32 (exact up to float32 summation order).

    ``path``: ``"auto"`` (GEMV for few rows, tiled for many), ``"gemv"`` or ``"tiled"``;
    ``num_threads`` defaults to ``torch.get_num_threads()``; ``target``: the native build (default:
    the best this CPU runs). ``activations="int8"`` quantizes x per block first (see the module
    docstring; ``path`` does not apply). Falls back to ``torch_quant_matmul`` (or
    ``torch_quant_matmul_int8``) without the native library. Raises ``ValueError`` on any
    inconsistent input, before native code runs.
    """
    q = check_weight(w, qtype, k)
    check_input(x, k)
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}.")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {list(ACTIVATIONS)}, got {activations!r}.")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {threads}.")
    op = native_quant_matmul(target)
    if activations == "int8":
        if op is None:
            return torch_quant_matmul_int8(x, w, qtype, k)
        return op.int8(x, w, q, k, threads)
    if op is None:
        return torch_quant_matmul(x, w, qtype, k)
    return op(x, w, q, k, path, threads)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 as the int8 path quantizes it: per row and block of ``block`` (32 or
    256) elements, ``dx = max|x| / 127`` and ``q = round_half_even(x * (1 / dx))`` clamped to
    [-127, 127] (float32 operations; q = 0 where dx = 0). Returns (q [M, K] int16,
    dx [M, K // block] float32)."""
    if block not in (32, 256):
        raise ValueError(f"block must be 32 or 256, got {block!r}.")
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % block != 0:
        raise ValueError(
            f"x must be float32 [M, K] with K a multiple of {block}, got {describe_tensor(x)}."
        )
    xb = x.reshape(x.shape[0], -1, block)
    d = xb.abs().amax(dim=2) / torch.tensor(127.0, dtype=torch.float32)
    inv = torch.where(d != 0, torch.tensor(1.0, dtype=torch.float32) / d, torch.zeros_like(d))
    codes = torch.round(xb * inv.unsqueeze(2)).clamp(-127, 127)  # torch.round: half to even
    return codes.reshape(x.shape).to(torch.int16), d


def torch_quant_matmul_int8(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``quant_matmul(..., activations="int8")`` in torch, in float64: x quantized by
    ``quantize_activations`` (exact as ``dx * q`` in float64) times the exact weights, rounded
    to float32 once (the kernel's own rounding is only its float32 per-block combination)."""
    q = check_weight(w, qtype, k)
    check_input(x, k)
    codes, dx = quantize_activations(x.contiguous(), q.block_elems)
    xq = codes.double().reshape(x.shape[0], -1, q.block_elems) * dx.double().unsqueeze(2)
    xq = xq.reshape(x.shape)
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float64)
    for n0 in range(0, w.shape[0], FALLBACK_ROWS):
        rows = w[n0 : n0 + FALLBACK_ROWS]
        y[:, n0 : n0 + rows.shape[0]] = xq @ dequantize_rows(rows, qtype, k).double().T
    return y.float()


def torch_quant_matmul(x: torch.Tensor, w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``quant_matmul`` in torch: ``FALLBACK_ROWS`` rows of W dequantized at a time."""
    check_weight(w, qtype, k)
    check_input(x, k)
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    for n0 in range(0, w.shape[0], FALLBACK_ROWS):
        rows = w[n0 : n0 + FALLBACK_ROWS]
        torch.matmul(x, dequantize_rows(rows, qtype, k).T, out=y[:, n0 : n0 + rows.shape[0]])
    return y


def dequantize_rows(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """w [N, row_bytes(qtype, k)] uint8 -> [N, k] float32, bit for bit what gguf-py's
    ``gguf.quants.dequantize`` gives (the same float32 operations in the same order)."""
    q = check_weight(w, qtype, k)
    blocks = w.reshape(-1, q.block_bytes)
    out = _DEQUANTIZE[q.name](blocks)
    return out.reshape(w.shape[0], k)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of each block as float32 [n, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _shifted(b: torch.Tensor, shape: tuple[int, ...], shifts: tuple[int, ...]) -> torch.Tensor:
    """``b`` (int32) reshaped to ``shape`` (its third dimension 1) shifted right by each of
    ``shifts`` along that dimension."""
    shift = torch.tensor(shifts, dtype=torch.int32).reshape(1, 1, len(shifts), 1)
    return b.reshape(shape) >> shift


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _fp16(b, 0)
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _fp16(b, 0)
    qs = _shifted(b[:, 2:].int(), (b.shape[0], -1, 1, 16), (0, 4))
    return d * ((qs & 15).reshape(b.shape[0], -1) - 8).float()


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of K-quant blocks from their 12 bytes (int32 [n, 12])."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _qk_45(b: torch.Tensor, *, high_bits: bool) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _fp16(b, 0), _fp16(b, 2)
    bi = b.int()
    sc, mn = _scale_min_k4(bi[:, 4:16])
    dl = (d * sc.float()).reshape(n, -1, 1)
    ml = (dmin * mn.float()).reshape(n, -1, 1)
    qs_at = 48 if high_bits else 16
    q = (_shifted(bi[:, qs_at : qs_at + 128], (n, -1, 1, 32), (0, 4)) & 15).reshape(n, -1, 32)
    if high_bits:
        qh = _shifted(bi[:, 16:48], (n, -1, 1, 32), tuple(range(8))) & 1
        q = q | (qh.reshape(n, -1, 32) << 4)
    return (dl * q.float() - ml).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    bi = b.int()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_fp16(b, 208) * scales).reshape(n, 16, 1)
    ql = (_shifted(bi[:, 0:128], (n, -1, 1, 64), (0, 4)) & 15).reshape(n, -1, 32)
    qh = (_shifted(bi[:, 128:192], (n, -1, 1, 32), (0, 2, 4, 6)) & 3).reshape(n, -1, 32)
    q = ((ql | (qh << 4)) - 32).reshape(n, 16, -1).float()
    return (d * q).reshape(n, 256)


_DEQUANTIZE: Final[dict[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_K": functools.partial(_qk_45, high_bits=False),
    "Q5_K": functools.partial(_qk_45, high_bits=True),
    "Q6_K": _q6_k,
}
