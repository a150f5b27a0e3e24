"""Triton kernels for the CUDA path, shipped as ``asyncpaged.kernels`` (source: top-level kernels/).

* ``reshape_and_cache`` / ``copy_blocks`` (``cache_ops``): write new K/V into slots; batched CoW.
* ``paged_attention`` (``paged_attention``): varlen decode/prefill/chunked prefill, split-K.
* ``TritonAttentionBackend`` / ``make_attention_backend`` (``backend``): the model-runner backend.

Every kernel has a pure-torch reference next to it; tests run them under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from .backend import TritonAttentionBackend, make_attention_backend
from .cache_ops import copy_blocks, reshape_and_cache
from .paged_attention import paged_attention

__all__ = [
    "TritonAttentionBackend",
    "copy_blocks",
    "make_attention_backend",
    "paged_attention",
    "reshape_and_cache",
]
