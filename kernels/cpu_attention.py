"""Paged decode attention on the CPU through the native kernel (``csrc/paged_decode.cpp``).

* ``paged_decode_attention``: checks its inputs and calls the library through ctypes;
* ``reference_paged_decode``: the same attention in float64 with plain torch (tests);
* ``CpuAttentionBackend``: ``TorchAttentionBackend`` with its decodes on the kernel (prefills, and
  any call the kernel cannot take, stay on the torch path);
* ``make_cpu_attention_backend``: that backend when the library builds, else the torch one.

Decode only: one query token per sequence, at position ``context_len - 1``; with a sliding window
``w`` it attends the last ``w`` positions (``attention.py``: key ``k`` is visible iff
``k > q_pos - w``). The kernel accumulates in fp32 and reads fp32 or bf16 caches. Nothing here
imports Triton (the package's ``__init__`` does, for the CUDA kernels).
"""

from __future__ import annotations

import ctypes
from typing import Final

import torch

from asyncpaged.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    _prefill_one,
    _write,
)
from asyncpaged.model.kv_cache import PagedKVCache

from .cpu_build import load_library

SUPPORTED_HEAD_DIMS: Final = frozenset({16, 32, 64, 80, 96, 128})
KV_DTYPE_CODES: Final = {torch.float32: 0, torch.bfloat16: 1}
BLOCK_SIZE_MULTIPLE: Final = 16
_STATUS_MESSAGES: Final = {
    1: "head_dim is not supported by this build",
    2: "block_size must be a multiple of 16",
    3: "num_heads must be a multiple of num_kv_heads",
    4: "a context length is < 1 or longer than its block table",
    5: "a block table entry in use is outside [0, num_blocks)",
    6: "the KV cache dtype must be float32 or bfloat16",
    7: "a sequence index or query row is out of range",
}


def is_available(target: str | None = None) -> bool:
    """Whether the kernel library builds and loads here (compiles it on first call)."""
    return load_library(target) is not None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_threads: int | None = None,
    target: str | None = None,
) -> torch.Tensor:
    """Decode attention of sequence ``i``'s query ``query[i]`` over its cached context.

    query [S, Hq, D] float32; key_cache [num_blocks, Hkv, D, bs], value_cache [num_blocks, Hkv,
    bs, D] (float32 or bfloat16, contiguous); block_tables [S, max_blocks] int64 (padding never
    read); context_lens [S] int64 -> out [S, Hq, D] float32. ``num_threads`` defaults to
    ``torch.get_num_threads()``; ``target`` picks a build (default: the best this CPU runs).
    """
    num_seqs = query.shape[0] if query.dim() == 3 else -1
    _check_inputs(query, key_cache, value_cache, block_tables, context_lens, sliding_window)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables and context_lens need {num_seqs} rows (one per query), got "
            f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}."
        )
    if out is None:
        out = torch.empty(query.shape, dtype=torch.float32)
    elif out.shape != query.shape or out.dtype != torch.float32 or not _rows_dense(out):
        raise ValueError(
            f"out must be float32 of shape {tuple(query.shape)} with contiguous [Hq, D] rows, "
            f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}."
        )
    lib = load_library(target)
    if lib is None:
        raise RuntimeError(
            "the CPU paged-attention kernel is unavailable (no g++ or the build failed, see the "
            "cpu_kernel_unavailable log event); use TorchAttentionBackend instead."
        )
    _launch(
        lib, out, query, key_cache, value_cache, block_tables, context_lens,
        None, None, num_seqs, scale, sliding_window, num_threads,
    )  # fmt: skip
    return out


def _rows_dense(t: torch.Tensor) -> bool:
    """[N, H, D] whose rows [H, D] are contiguous (the row stride may be larger)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    tensors = (query, key_cache, value_cache, block_tables, context_lens)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"all tensors must be on the CPU, got {[str(t.device) for t in tensors]}.")
    if query.dtype != torch.float32 or not _rows_dense(query):
        raise ValueError(
            f"query must be float32 [S, Hq, D] with contiguous [Hq, D] rows, got {query.dtype} "
            f"{tuple(query.shape)} strides {query.stride()}."
        )
    _, num_heads, head_dim = query.shape
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            f"key_cache/value_cache must be 4-D, got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}."
        )
    num_blocks, kv_heads, _, block_size = key_cache.shape
    if tuple(key_cache.shape) != (num_blocks, kv_heads, head_dim, block_size) or tuple(
        value_cache.shape
    ) != (num_blocks, kv_heads, block_size, head_dim):
        raise ValueError(
            "expected key_cache [num_blocks, Hkv, D, block_size] and value_cache [num_blocks, "
            f"Hkv, block_size, D] with D = {head_dim}, got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}."
        )
    if key_cache.dtype not in KV_DTYPE_CODES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"the KV cache must be float32 or bfloat16 (both the same), got {key_cache.dtype} "
            f"and {value_cache.dtype}."
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous.")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {sorted(SUPPORTED_HEAD_DIMS)}, got {head_dim}.")
    if block_size % BLOCK_SIZE_MULTIPLE != 0:
        raise ValueError(f"block_size must be a multiple of 16, got {block_size}.")
    if num_heads % kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_heads})."
        )
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be int64 [S, max_blocks] with contiguous rows, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}."
        )
    if context_lens.dtype != torch.int64 or context_lens.dim() != 1:
        raise ValueError(
            f"context_lens must be int64 [S], got {context_lens.dtype} {tuple(context_lens.shape)}."
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be > 0 or None, got {sliding_window}.")


def _launch(
    lib: ctypes.CDLL,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    seq_indices: torch.Tensor | None,
    query_rows: torch.Tensor | None,
    num_items: int,
    scale: float,
    sliding_window: int | None,
    num_threads: int | None,
) -> None:
    """Call the kernel on checked inputs; item ``i`` is sequence ``seq_indices[i]`` (default
    ``i``) of the tables, reading and writing query/out row ``query_rows[i]`` (default ``i``)."""
    context_lens = context_lens.contiguous()
    num_blocks, kv_heads, head_dim, block_size = key_cache.shape
    status = lib.asyncpaged_paged_decode(
        out.data_ptr(), out.stride(0),
        query.data_ptr(), query.stride(0), query.shape[0],
        key_cache.data_ptr(), value_cache.data_ptr(), KV_DTYPE_CODES[key_cache.dtype],
        num_blocks, kv_heads, head_dim, block_size,
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
        block_tables.shape[0],
        context_lens.data_ptr(),
        None if seq_indices is None else seq_indices.data_ptr(),
        None if query_rows is None else query_rows.data_ptr(),
        num_items, query.shape[1], scale, sliding_window or 0,
        torch.get_num_threads() if num_threads is None else num_threads,
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"paged decode attention refused its inputs: {_STATUS_MESSAGES.get(status, status)}."
        )


def reference_paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The same attention in float64 (gather each sequence's blocks, softmax): [S, Hq, D]."""
    num_seqs, num_heads, head_dim = query.shape
    _, kv_heads, _, block_size = key_cache.shape
    group = num_heads // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for i in range(num_seqs):
        ctx = int(context_lens[i])
        start = 0 if sliding_window is None else max(0, ctx - sliding_window)
        blocks = block_tables[i, : -(-ctx // block_size)]
        keys = key_cache[blocks].double().permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
        values = value_cache[blocks].double().permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)
        keys, values = keys[:, start:ctx], values[:, start:ctx]  # [Hkv, n, D]
        q = query[i].double().view(kv_heads, group, head_dim)
        probs = torch.softmax(q @ keys.transpose(1, 2) * scale, dim=-1)  # [Hkv, G, n]
        out[i] = (probs @ values).reshape(num_heads, head_dim)
    return out


class CpuAttentionBackend(TorchAttentionBackend):
    """``TorchAttentionBackend`` with the decodes on the native kernel.

    K/V are written exactly as the parent writes them; prefills use the parent's per-sequence
    path. A call the kernel cannot take (library unavailable, non-CPU tensors, a cache dtype
    other than float32/bfloat16, an unsupported head dim or block size) goes to the parent
    whole. Per step the decode rows are turned into index tensors once (keyed on the metadata
    object, reused by every layer), so the kernel gathers nothing.
    """

    def __init__(self, decode_group_size: int = 8, *, target: str | None = None) -> None:
        super().__init__(decode_group_size)
        self._library = load_library(target)
        self._rows_metadata: AttentionMetadata | None = None  # kept alive: identity is the key
        self._rows = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))

    @property
    def is_native(self) -> bool:
        """Whether the kernel library loaded (otherwise every call takes the torch path)."""
        return self._library is not None

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        lib = self._library
        if lib is None or not metadata.decode_indices or not _kernel_fits(query, kv_cache):
            return super().forward(
                layer_idx, query, key, value, kv_cache, metadata,
                scale=scale, sliding_window=sliding_window,
            )  # fmt: skip
        _write(kv_cache, layer_idx, key, value, metadata)
        key_cache, value_cache = kv_cache.layer(layer_idx)
        q = query if query.dtype == torch.float32 and _rows_dense(query) else query.float()
        q = q if _rows_dense(q) else q.contiguous()
        out = torch.empty(query.shape, dtype=torch.float32)  # [T, Hq, D]
        seq_indices, query_rows = self._decode_rows(metadata)
        _launch(
            lib, out, q, key_cache, value_cache, metadata.block_tables, metadata.context_lens,
            seq_indices, query_rows, seq_indices.numel(), scale, sliding_window, None,
        )  # fmt: skip
        for i in metadata.prefill_indices:
            _prefill_one(i, out, query, key_cache, value_cache, metadata, scale, sliding_window)
        return out if query.dtype == torch.float32 else out.to(query.dtype)

    def _decode_rows(self, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence index, query row) of each decode, as int64 tensors."""
        if md is not self._rows_metadata:
            seqs = md.decode_indices
            rows = [md.query_start_loc_host[i] for i in seqs]
            self._rows = (
                torch.tensor(seqs, dtype=torch.int64),
                torch.tensor(rows, dtype=torch.int64),
            )
            self._rows_metadata = md
        return self._rows


def _kernel_fits(query: torch.Tensor, kv_cache: PagedKVCache) -> bool:
    """Whether the kernel takes this layer's call (else the torch path does)."""
    return (
        query.device.type == "cpu"
        and kv_cache.key.device.type == "cpu"
        and query.dim() == 3
        and query.is_floating_point()
        and kv_cache.dtype in KV_DTYPE_CODES
        and kv_cache.head_dim in SUPPORTED_HEAD_DIMS
        and query.shape[2] == kv_cache.head_dim
        and kv_cache.block_size % BLOCK_SIZE_MULTIPLE == 0
        and query.shape[1] % kv_cache.num_kv_heads == 0
    )


def make_cpu_attention_backend(decode_group_size: int = 8) -> AttentionBackend:
    """``CpuAttentionBackend`` when the kernel library builds here, else ``TorchAttentionBackend``
    (the build failure is logged once as ``cpu_kernel_unavailable``)."""
    backend = CpuAttentionBackend(decode_group_size)
    if backend.is_native:
        return backend
    return TorchAttentionBackend(decode_group_size)
