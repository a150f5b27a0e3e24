"""Matmul with weights kept as int4, int8 or fp8 codes times grouped scales
(``csrc/scaled_matmul.cpp``): compressed-tensors' ``pack-quantized`` and ``float-quantized``
weights.

``scaled_matmul(x, w, layout)`` is ``x @ dequantize_codes(w, layout).T``: ``x`` [M, K] float32,
``w`` [N, row_bytes] uint8 of ``layout.code`` codes, ``y`` [M, N] float32. An element (n, k) has
the scale ``scales[n // row_block, k // group_size]`` (and the zero ``zeros[...]``)::

    code      row bytes  stored                        weight
    int8      K          u = q + 128                   (u - z) * s
    int4      K / 2      u = q + 8, per run of 32:     (u - z) * s
                         byte j = u[j] | u[16 + j] << 4
    fp8_e4m3  K          float8 e4m3fn f               f * s

``z`` is the zero point plus ``2**(bits - 1)`` (``zeros``; ``None``: symmetric, z = 2**(bits -
1)). The product is computed in float32 and rounded to ``scale_dtype`` (bfloat16 or float16
scales), as compressed-tensors' ``dequantize`` computes in the scale's dtype: each weight is the
float32 value compressed-tensors decompresses to. The native kernel decodes in registers and
sums in float32, so it differs from ``x @ W.T`` in float32 only by summation order:
``|y - y_exact| <= K * 2**-23 * (|x| @ |W|.T)``. Few rows take a GEMV, more rows a tiled path
(as ``quant_matmul``).

Without the native library ``scaled_matmul`` falls back to ``torch_scaled_matmul``:
``dequantize_codes`` of a few hundred rows at a time and a float32 matmul.

**int8 activations** (``activations="int8"``, int4 and int8 codes; opt-in, not exact): each row
of x is quantized per block of ``activation_block(layout)`` elements (the weight's group size,
or 128 for per-channel and per-tensor weights, 32 when 128 does not divide K): ``dx = max|x| /
127`` in float32, codes ``round(x / dx)`` ties to even. Each block's dot product with the
weight's unsigned codes is exact in int32 (``vpdpbusd`` on AVX512-VNNI CPUs, ``pmaddwd``
otherwise), the zero point enters as ``z * sum(x codes)``, and only the scaling by ``dx`` times
the stored scale and the sum over blocks round in float32 (``torch_scaled_matmul_int8`` is the
float64 reference). Per-channel weights take blocks of 128 as the common group size of grouped
checkpoints: x's error is then what a group-128 checkpoint's is, at a quarter of the float
scalings of blocks of 32. The scales are used as stored (a bf16 / fp16 scale is exact in
float32); the per-weight rounding of the exact path has no counterpart here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from dataclasses import dataclass
from typing import Final

import torch

from .cpu_build import load_library
from .quant_matmul import check_input, describe_tensor

__all__ = [
    "CODES",
    "ScaledLayout",
    "activation_block",
    "dequantize_codes",
    "native_scaled_matmul",
    "scaled_matmul",
    "torch_scaled_matmul",
    "torch_scaled_matmul_int8",
]

#: code name -> (native id, bits per code)
CODES: Final = {"int4": (4, 4), "int8": (8, 8), "fp8_e4m3": (3, 8)}
ROUNDINGS: Final = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PATHS: Final = {"auto": 0, "gemv": 1, "tiled": 2}
ACTIVATIONS: Final = ("float32", "int8")
CHANNEL_ACTIVATION_BLOCK: Final = 128
RUN: Final = 32  # elements per decode run: K and group_size are multiples of it
FALLBACK_ROWS: Final = 256
_STATUS_MESSAGES: Final = {
    6: "unknown code or rounding",
    7: "inconsistent sizes or path",
    8: "out of memory for the packed copy of x",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaledLayout:
    """How ``w``'s codes become weights: ``code`` (``CODES``), ``in_features`` (K), ``scales``
    float32 [ceil(N / row_block), ceil(K / group_size)], ``zeros`` (same shape, or None),
    ``group_size`` (a power of two >= 32, or K and more: one group per row), ``row_block`` (rows
    per scale row: 1, a block height, or N for one scale), ``scale_dtype`` (the dtype the
    scales were stored in: float32, bfloat16 or float16)."""

    code: str
    in_features: int
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    row_block: int
    scale_dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.in_features * CODES[self.code][1] // 8

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    @property
    def group_shift(self) -> int:
        """log2(group_size), or 62 for a single group per row."""
        return 62 if self.group_size >= self.in_features else self.group_size.bit_length() - 1

    def to(self, device: torch.device) -> ScaledLayout:
        """The layout with its scales and zeros on ``device``."""
        zeros = None if self.zeros is None else self.zeros.to(device)
        return dataclasses.replace(self, scales=self.scales.to(device), zeros=zeros)


def check_layout(w: torch.Tensor, layout: ScaledLayout) -> None:
    """``w`` and ``layout`` must agree (``ValueError`` otherwise)."""
    if layout.code not in CODES:
        raise ValueError(f"code must be one of {sorted(CODES)}, got {layout.code!r}.")
    k = layout.in_features
    if not isinstance(k, int) or k <= 0 or k % RUN != 0:
        raise ValueError(f"in_features must be a positive multiple of {RUN}, got {k!r}.")
    g = layout.group_size
    if not isinstance(g, int) or g < RUN or (g < k and g & (g - 1)):
        raise ValueError(
            f"group_size must be a power of two >= {RUN} or at least in_features ({k}), got {g!r}."
        )
    if layout.scale_dtype not in ROUNDINGS:
        raise ValueError(f"scale_dtype must be one of {list(ROUNDINGS)}, got {layout.scale_dtype}.")
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.device.type != "cpu":
        raise ValueError(f"w must be a uint8 CPU tensor, got {describe_tensor(w)}.")
    if w.dim() != 2 or w.shape[1] != layout.row_bytes or not w.is_contiguous():
        raise ValueError(
            f"w must be contiguous [N, {layout.row_bytes}] ({k} {layout.code} codes per row), "
            f"got {tuple(w.shape)} strides {w.stride()}."
        )
    n = int(w.shape[0])
    if not isinstance(layout.row_block, int) or layout.row_block < 1:
        raise ValueError(f"row_block must be a positive int, got {layout.row_block!r}.")
    want = (-(-n // layout.row_block), layout.num_groups)
    for name, t in (("scales", layout.scales), ("zeros", layout.zeros)):
        if t is None:
            continue
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous float32 CPU tensor, got {describe_tensor(t)}."
            )
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} for {n} rows, got {tuple(t.shape)}.")
    if layout.zeros is not None and layout.code == "fp8_e4m3":
        raise ValueError("fp8 codes have no zero points: zeros must be None.")


def activation_block(layout: ScaledLayout) -> int:
    """The block of x the int8-activations path quantizes together: the weight's group size,
    else 128 when it divides K, else 32."""
    if layout.group_size < layout.in_features:
        return layout.group_size
    k = layout.in_features
    return CHANNEL_ACTIVATION_BLOCK if k % CHANNEL_ACTIVATION_BLOCK == 0 else RUN


class NativeScaledMatmul:
    """The scaled matmul of one loaded kernel library, unchecked (``scaled_matmul`` checks)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self._matmul = lib.asyncpaged_scaled_matmul
        self._matmul.restype = i32
        self._matmul.argtypes = [
            ptr,
            i64,
            i64,
            ptr,
            i64,
            i64,
            i32,
            ptr,
            ptr,
            i64,
            i32,
            i64,
            i32,
            ptr,
            i32,
            i32,
        ]
        self._int8 = lib.asyncpaged_scaled_matmul_int8
        self._int8.restype = i32
        self._int8.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, ptr, ptr, i64, i32, i64, i32,
                               ptr, i32]  # fmt: skip

    def int8(
        self, x: torch.Tensor, w: torch.Tensor, layout: ScaledLayout, num_threads: int
    ) -> torch.Tensor:
        """The int8-activations product (int4 / int8 codes)."""
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        zeros = None if layout.zeros is None else layout.zeros.data_ptr()
        status = self._int8(
            x.data_ptr(), x.shape[0], layout.in_features, w.data_ptr(), w.shape[0], w.shape[1],
            CODES[layout.code][0], layout.scales.data_ptr(), zeros, layout.num_groups,
            layout.group_shift, layout.row_block, activation_block(layout).bit_length() - 1,
            y.data_ptr(), num_threads,
        )  # fmt: skip
        if status != 0:
            message = _STATUS_MESSAGES.get(status, str(status))
            raise ValueError(f"the scaled matmul kernel refused its inputs: {message}.")
        return y

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, layout: ScaledLayout, path: str, num_threads: int
    ) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        zeros = None if layout.zeros is None else layout.zeros.data_ptr()
        status = self._matmul(
            x.data_ptr(),
            x.shape[0],
            layout.in_features,
            w.data_ptr(),
            w.shape[0],
            w.shape[1],
            CODES[layout.code][0],
            layout.scales.data_ptr(),
            zeros,
            layout.num_groups,
            layout.group_shift,
            layout.row_block,
            ROUNDINGS[layout.scale_dtype],
            y.data_ptr(),
            PATHS[path],
            num_threads,
        )
        if status != 0:
            message = _STATUS_MESSAGES.get(status, str(status))
            raise ValueError(f"the scaled matmul kernel refused its inputs: {message}.")
        return y


@functools.cache
def native_scaled_matmul(target: str | None = None) -> NativeScaledMatmul | None:
    """The kernel of the library for ``target`` (default: the best this CPU runs), or ``None``
    when it cannot be built here."""
    lib = load_library(target)
    return None if lib is None else NativeScaledMatmul(lib)


def scaled_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    layout: ScaledLayout,
    *,
    num_threads: int | None = None,
    target: str | None = None,
    path: str = "auto",
    activations: str = "float32",
) -> torch.Tensor:
    """``x @ dequantize_codes(w, layout).T``: x [M, K] float32, w [N, layout.row_bytes] uint8,
    contiguous on the CPU -> [M, N] float32 (exact up to float32 summation order).

    ``activations``: ``"float32"`` (exact) or ``"int8"`` (x quantized per block, int4 and int8
    codes only: see the module docstring; ``path`` is not taken).
    ``path``: ``"auto"``, ``"gemv"`` or ``"tiled"``; ``num_threads`` defaults to
    ``torch.get_num_threads()``; ``target``: the native build. Falls back to
    ``torch_scaled_matmul`` without the native library. Raises ``ValueError`` on any
    inconsistent input, before native code runs."""
    check_layout(w, layout)
    check_input(x, layout.in_features)
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}, got {path!r}.")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}.")
    if activations == "int8" and layout.code == "fp8_e4m3":
        raise ValueError("activations='int8' needs int4 or int8 codes, got fp8_e4m3.")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {threads}.")
    op = native_scaled_matmul(target)
    if activations == "int8":
        if op is None:
            return torch_scaled_matmul_int8(x, w, layout).float()
        return op.int8(x, w, layout, threads)
    if op is None:
        return torch_scaled_matmul(x, w, layout)
    return op(x, w, layout, path, threads)


def torch_scaled_matmul(x: torch.Tensor, w: torch.Tensor, layout: ScaledLayout) -> torch.Tensor:
    """``scaled_matmul`` in torch: ``FALLBACK_ROWS`` rows of W dequantized at a time."""
    check_layout(w, layout)
    check_input(x, layout.in_features)
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    step = FALLBACK_ROWS // layout.row_block * layout.row_block or layout.row_block
    for n0 in range(0, w.shape[0], step):
        rows = w[n0 : n0 + step]
        weights = dequantize_codes(rows, layout, first_row=n0)
        torch.matmul(x, weights.T, out=y[:, n0 : n0 + rows.shape[0]])
    return y


def unpack_codes(w: torch.Tensor, layout: ScaledLayout) -> torch.Tensor:
    """The stored unsigned codes [N, K] as int32 (int4 and int8), or the fp8 bytes as
    ``float8_e4m3fn``."""
    if layout.code == "fp8_e4m3":
        return w.view(torch.float8_e4m3fn)
    if layout.code == "int8":
        return w.to(torch.int32)
    runs = w.to(torch.int32).reshape(w.shape[0], -1, RUN // 2)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(w.shape[0], -1)


def dequantize_codes(w: torch.Tensor, layout: ScaledLayout, first_row: int = 0) -> torch.Tensor:
    """Rows ``first_row ..`` of W (``w`` holds them) as float32 [n, K]: compressed-tensors'
    ``dequantize`` in the scale's dtype, ``(q - zp) * s`` or ``f * s``, then float32.
    ``first_row`` is a multiple of ``row_block``."""
    n, k = int(w.shape[0]), layout.in_features
    dtype = layout.scale_dtype
    r0 = first_row // layout.row_block
    r1 = -(-(first_row + n) // layout.row_block)

    def per_element(t: torch.Tensor) -> torch.Tensor:  # [scale rows, groups] -> [n, k]
        t = t[r0:r1].repeat_interleave(layout.row_block, 0)[:n]
        return t.repeat_interleave(min(layout.group_size, k), 1)[:, :k].to(dtype)

    codes = unpack_codes(w, layout).to(dtype)
    if layout.code != "fp8_e4m3":
        offset = torch.full((1,), 1 << (CODES[layout.code][1] - 1), dtype=torch.float32)
        zeros = layout.zeros if layout.zeros is not None else offset.expand(layout.scales.shape)
        codes = codes - per_element(zeros)
    return (codes * per_element(layout.scales)).float()


def torch_scaled_matmul_int8(
    x: torch.Tensor, w: torch.Tensor, layout: ScaledLayout, *, magnitude: bool = False
) -> torch.Tensor:
    """The int8-activations product in float64: x quantized exactly as the kernel quantizes it
    (float32 ``dx`` and division, ties to even), integer block sums and zero-point corrections,
    then ``dx * scale`` per block summed in float64 -> [M, N] float64. ``magnitude``: the sum
    of the terms' absolute values instead (what bounds the kernel's float32 rounding)."""
    check_layout(w, layout)
    check_input(x, layout.in_features)
    assert layout.code in ("int4", "int8"), layout.code
    m, k, n = x.shape[0], layout.in_features, int(w.shape[0])
    block = activation_block(layout)
    xb = x.reshape(m, k // block, block)
    dx = xb.abs().amax(-1) / 127.0  # [M, nb] float32
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    q = torch.where(dx[..., None] > 0, torch.round(xb / safe[..., None]), 0.0).clamp(-127, 127)
    u = unpack_codes(w, layout).double().reshape(n, k // block, block)  # [N, nb, B]
    isum = torch.einsum("mbj,nbj->mnb", q.double(), u)  # exact: integers below 2**53
    g = torch.arange(k // block) * block // min(layout.group_size, k)  # block -> group
    rows = torch.arange(n) // layout.row_block
    scale = layout.scales.double()[rows][:, g]  # [N, nb]
    offset = float(1 << (CODES[layout.code][1] - 1))
    z = layout.zeros.double()[rows][:, g] if layout.zeros is not None else torch.full_like(
        scale, offset)  # fmt: skip
    corr = z[None] * q.double().sum(-1)[:, None, :]  # [M, N, nb]
    terms = (isum - corr) * dx.double()[:, None, :] * scale[None]
    return (terms.abs() if magnitude else terms).sum(-1)
