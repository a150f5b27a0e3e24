"""Kernels of asyncpaged (``asyncpaged.kernels``; the C++ sources are the top-level kernels/csrc).

CUDA (Triton; tests run them under ``TRITON_INTERPRET=1``):

* ``reshape_and_cache`` / ``copy_blocks`` (``cache_ops``): write new K/V into slots; batched CoW.
* ``paged_attention`` (``paged_attention``): varlen decode/prefill/chunked prefill, split-K.
* ``TritonAttentionBackend`` / ``make_attention_backend`` (``backend``): the model-runner backend.
* ``triton_quant_matmul`` / ``triton_scaled_matmul`` (``triton_quant_matmul``): products with
  GGUF-quantized and int4 / int8 / fp8 weights, decoded in registers.

CPU (C++ through ctypes, built on first use by ``cpu_build``):

* ``paged_decode_attention`` / ``CpuAttentionBackend`` / ``make_cpu_attention_backend``
  (``cpu_attention``): paged decode attention; the backend runs the K/V write, decodes and
  prefills natively.
* ``paged_prefill_attention`` / ``paged_cache_write`` (``cpu_ops``): prefill over the paged cache
  (full, chunked, prefix hits, sliding window); the K/V write (slot -1 skipped).
* ``rms_norm`` / ``add_rms_norm`` / ``rotary_`` / ``silu_mul`` / ``fused_ops`` (``cpu_fused``):
  fused fp32 elementwise work of the Llama family (residual add + RMSNorm, RoPE, SiLU x up).

Every kernel has a pure-torch reference next to it. Names are imported lazily, so the CPU path
never imports Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TritonAttentionBackend": "backend",
    "make_attention_backend": "backend",
    "copy_blocks": "cache_ops",
    "reshape_and_cache": "cache_ops",
    "paged_attention": "paged_attention",
    "triton_quant_matmul": "triton_quant_matmul",
    "triton_scaled_matmul": "triton_quant_matmul",
    "CpuAttentionBackend": "cpu_attention",
    "make_cpu_attention_backend": "cpu_attention",
    "paged_decode_attention": "cpu_attention",
    "paged_prefill_attention": "cpu_ops",
    "paged_cache_write": "cpu_ops",
    "add_rms_norm": "cpu_fused",
    "fused_ops": "cpu_fused",
    "rms_norm": "cpu_fused",
    "rotary_": "cpu_fused",
    "silu_mul": "cpu_fused",
}

__all__ = [
    "CpuAttentionBackend",
    "TritonAttentionBackend",
    "add_rms_norm",
    "copy_blocks",
    "fused_ops",
    "make_attention_backend",
    "make_cpu_attention_backend",
    "paged_attention",
    "paged_cache_write",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_",
    "silu_mul",
    "triton_quant_matmul",
    "triton_scaled_matmul",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
