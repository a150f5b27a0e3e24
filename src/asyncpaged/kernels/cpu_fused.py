"""Fused elementwise ops of the Llama family on the CPU (``csrc/fused_ops.cpp``), fp32 or bf16.

* ``rms_norm`` / ``add_rms_norm``: ``weight * (h * rsqrt(mean(h^2) + eps))`` of each row, where
  ``h`` is ``x`` or, for ``add_rms_norm``, the residual after ``residual += x`` (in place);
* ``rotary_``: RoPE in place on q [T, Hq, D] and k [T, Hkv, D], "rotate half" (GPT-NeoX) layout,
  with the cos/sin [T, D] the model computes (``asyncpaged.model.rotary``);
* ``silu_mul``: ``silu(gate) * up`` (``gate / (1 + exp(-gate))``, an accurate exp);
* ``FusedOps``: the same entry points without input checks, for the model's hot path;
* ``reference_*``: each op in plain torch, the model's own torch code (pass float64 tensors for a
  float64 reference).

Every tensor of a call is float32, or every one bfloat16 (the model's dtype; ``silu_mul`` is
float32 only: in bfloat16 it measured no faster than torch's SiLU and multiply). In bfloat16 the
norm and RoPE compute in fp32 and round to bf16 wherever the torch code stores a bf16 tensor (the
residual sum, the normalised row before the weight, each RoPE product and sum, every output), so
they follow the model's own bf16 code op for op.

Exactness: the kernels round every product and quotient as the torch ops do; the sum of squares
of the norm is added in another order, fp32 products may fuse into the following add (FMA), and
the exp is a ~1 ulp polynomial where torch's is Sleef's ~1 ulp one. Results agree with the torch
ops to a few fp32 ulps (tests check ~1e-6 relative), which is the latitude a GEMM's summation
order already takes; in bf16 that shows only where such an ulp crosses a bf16 rounding boundary
(one bf16 ulp, rarely), and RoPE stores torch's bits. Work runs on ``torch.get_num_threads()``
threads when a call is large enough.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import load_library
from .cpu_ops import KV_DTYPE_CODES as DTYPE_CODES  # the library's dtype codes

__all__ = [
    "FusedOps",
    "add_rms_norm",
    "fused_ops",
    "reference_add_rms_norm",
    "reference_rms_norm",
    "reference_rotary",
    "reference_silu_mul",
    "rms_norm",
    "rotary_",
    "silu_mul",
]


class FusedOps:
    """The fused ops of one loaded kernel library, unchecked: every tensor of a call is float32,
    or every one bfloat16 (``silu_mul``: float32), on the CPU, rows (the last dimension, and
    [heads, D] for q/k) contiguous; the methods' docstrings give the shapes. ``num_threads``
    defaults to ``torch.get_num_threads()``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self._norm = lib.asyncpaged_add_rms_norm
        self._norm.restype = i32
        self._norm.argtypes = [
            ptr, i64, ptr, i64,  # residual, residual_stride, x, x_stride
            ptr, ptr, i64,  # weight, out, out_stride
            i64, i64, ctypes.c_float, i32, i32,  # num_rows, hidden, eps, num_threads, dtype
        ]  # fmt: skip
        self._rotary = lib.asyncpaged_rotary
        self._rotary.restype = i32
        self._rotary.argtypes = [
            ptr, i64, i64, ptr, i64, i64,  # q, q_stride, q_heads, k, k_stride, k_heads
            ptr, ptr, i64,  # cos, sin, cs_stride
            i64, i64, i32, i32,  # num_tokens, head_dim, num_threads, dtype
        ]  # fmt: skip
        self._silu_mul = lib.asyncpaged_silu_mul
        self._silu_mul.restype = i32
        self._silu_mul.argtypes = [ptr, ptr, ptr, i64, i32, i32]

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int | None = None
    ) -> torch.Tensor:
        """x [T, H], weight [H] -> out [T, H] (new)."""
        out = torch.empty(x.shape, dtype=x.dtype)
        status = self._norm(
            x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), out.stride(0),
            x.shape[0], x.shape[1], eps, _threads(num_threads), DTYPE_CODES[x.dtype],
        )  # fmt: skip
        _check_status(status, "rms_norm")
        return out

    def add_rms_norm(
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        num_threads: int | None = None,
    ) -> torch.Tensor:
        """residual [T, H] += x [T, H] (in place); returns the norm of the sum, [T, H] (new)."""
        out = torch.empty(residual.shape, dtype=residual.dtype)
        status = self._norm(
            residual.data_ptr(), residual.stride(0), x.data_ptr(), x.stride(0),
            weight.data_ptr(), out.data_ptr(), out.stride(0),
            residual.shape[0], residual.shape[1], eps, _threads(num_threads),
            DTYPE_CODES[residual.dtype],
        )  # fmt: skip
        _check_status(status, "add_rms_norm")
        return out

    def rotary_(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_threads: int | None = None,
    ) -> None:
        """q [T, Hq, D] and k [T, Hkv, D] (or None) rotated in place by cos/sin [T, D]."""
        num_tokens, q_heads, head_dim = q.shape
        status = self._rotary(
            q.data_ptr(), q.stride(0), q_heads,
            None if k is None else k.data_ptr(), 0 if k is None else k.stride(0),
            0 if k is None else k.shape[1],
            cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            num_tokens, head_dim, _threads(num_threads), DTYPE_CODES[q.dtype],
        )  # fmt: skip
        _check_status(status, "rotary")

    def silu_mul(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        out: torch.Tensor | None = None,
        num_threads: int | None = None,
    ) -> torch.Tensor:
        """gate, up [..., I] contiguous -> silu(gate) * up into ``out`` (may be gate or up;
        default new)."""
        if out is None:
            out = torch.empty(gate.shape, dtype=torch.float32)
        status = self._silu_mul(
            gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), _threads(num_threads),
            DTYPE_CODES[torch.float32],
        )  # fmt: skip
        _check_status(status, "silu_mul")
        return out


@functools.cache
def fused_ops(target: str | None = None) -> FusedOps | None:
    """The fused ops of the library for ``target`` (default: the best this CPU runs), or
    ``None`` when it cannot be built here (callers keep their torch code)."""
    lib = load_library(target)
    return None if lib is None else FusedOps(lib)


def _threads(num_threads: int | None) -> int:
    return torch.get_num_threads() if num_threads is None else num_threads


def _check_status(status: int, op: str) -> None:
    if status != 0:
        raise ValueError(f"the fused {op} kernel refused its inputs (status {status}).")


def _ops(target: str | None) -> FusedOps:
    ops = fused_ops(target)
    if ops is None:
        raise RuntimeError(
            "the CPU fused kernels are unavailable (no g++ or the build failed, see the "
            "cpu_kernel_unavailable log event); use the torch ops instead."
        )
    return ops


def _check_rows(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> None:
    """``t`` a ``dim``-D CPU tensor with contiguous rows, of ``dtype`` (None: float32 or
    bfloat16)."""
    ok = t.dtype in DTYPE_CODES if dtype is None else t.dtype == dtype
    if not ok or t.device.type != "cpu" or t.dim() != dim:
        want = "float32 or bfloat16" if dtype is None else str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{name} must be a {dim}-D {want} CPU tensor, got {t.dtype} {tuple(t.shape)} on "
            f"{t.device}."
        )
    inner = t[0] if dim == 3 and t.shape[0] > 0 else t
    if t.stride(-1) != 1 or (dim == 3 and not inner.is_contiguous()):
        raise ValueError(f"{name} needs contiguous rows, got strides {t.stride()}.")


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    _check_rows("x", x, 2)
    _check_rows("weight", weight, 1, x.dtype)
    if weight.shape[0] != x.shape[1] or x.shape[1] == 0:
        raise ValueError(
            f"weight must be [H] for x [T, H] with H > 0, got {tuple(weight.shape)} and "
            f"{tuple(x.shape)}."
        )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    num_threads: int | None = None,
    target: str | None = None,
) -> torch.Tensor:
    """x [T, H], weight [H] (float32, or both bfloat16) -> ``weight * (x * rsqrt(mean(x^2) +
    eps))``, [T, H] (in bfloat16 the normalised row is rounded before the weight multiplies it,
    as ``reference_rms_norm``)."""
    _check_norm(x, weight)
    return _ops(target).rms_norm(x, weight, eps, num_threads)


def add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    num_threads: int | None = None,
    target: str | None = None,
) -> torch.Tensor:
    """``residual += x`` in place (both [T, H], float32 or bfloat16), then
    ``rms_norm(residual)``."""
    _check_norm(residual, weight)
    _check_rows("x", x, 2, residual.dtype)
    if x.shape != residual.shape:
        raise ValueError(f"x must be shaped like residual {tuple(residual.shape)}, got {x.shape}.")
    return _ops(target).add_rms_norm(residual, x, weight, eps, num_threads)


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_threads: int | None = None,
    target: str | None = None,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] (float32 or bfloat16, [heads, D] contiguous per
    token) in place by cos/sin [T, D] (q's dtype, contiguous rows, the same strides), D even."""
    _check_rows("q", q, 3)
    num_tokens, _, head_dim = q.shape
    if k is not None:
        _check_rows("k", k, 3, q.dtype)
        if k.shape[0] != num_tokens or k.shape[2] != head_dim:
            raise ValueError(f"k must be [{num_tokens}, Hkv, {head_dim}], got {tuple(k.shape)}.")
    _check_rows("cos", cos, 2, q.dtype)
    _check_rows("sin", sin, 2, q.dtype)
    if head_dim % 2 or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(
            f"cos/sin must be [{num_tokens}, {head_dim}] (D even), got {tuple(cos.shape)} and "
            f"{tuple(sin.shape)}."
        )
    if sin.stride() != cos.stride():
        raise ValueError(f"cos and sin need the same strides, got {cos.stride()}, {sin.stride()}.")
    _ops(target).rotary_(q, k, cos, sin, num_threads)


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    target: str | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous float32 CPU tensors of one shape; ``out`` (default new)
    may be ``gate`` or ``up``."""
    for name, t in (("gate", gate), ("up", up), *((("out", out),) if out is not None else ())):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 on the CPU, got {t.dtype}.")
        if t.shape != gate.shape:
            raise ValueError(f"{name} must be shaped {tuple(gate.shape)}, got {tuple(t.shape)}.")
    return _ops(target).silu_mul(gate, up, out, num_threads)


# ---- references: the model's torch code ----------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``asyncpaged.model.llama.RMSNorm``: in x's dtype, except that a bfloat16 row is normalised
    in float32 and rounded back before the weight multiplies it (as transformers does)."""
    h = x.float() if x.dtype == torch.bfloat16 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the new residual ``residual + x``, its norm); nothing in place."""
    h = residual + x
    return h, reference_rms_norm(h, weight, eps)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``asyncpaged.model.rotary.apply_rotary``: x [T, heads, D] -> rotated (new)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up
