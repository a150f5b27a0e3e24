"""Prefill attention and the K/V cache write on the CPU through the native library.

* ``paged_prefill_attention``: causal attention of sequences' new query rows over their paged
  context (``csrc/paged_prefill.cpp``): full prefill, chunked prefill and prefix-cache hits alike;
* ``reference_paged_prefill``: the same in float64 with plain torch (tests);
* ``paged_cache_write``: new K/V rows into their slots (``csrc/cache_write.cpp``), bit-identical
  to ``PagedKVCache.write`` (a quantized cache's codes and scales included);
* the input checks and constants shared with the decode wrapper (``cpu_attention.py``).

Positions: sequence ``i`` has ``q_len = query_start_loc[i+1] - query_start_loc[i]`` new rows at
positions ``context_len - q_len ..``; the row at position ``p`` sees keys ``k <= p`` (and
``k > p - w`` with a sliding window ``w``), as in ``asyncpaged.model.attention``. Scores are
``scale * q.k``, or ``softcap * tanh(scale * q.k / softcap)`` with a ``softcap`` (Gemma 2's
attention logit softcapping), before the mask and the softmax. Head dims: ``SUPPORTED_HEAD_DIMS``.

Caches: float32, bfloat16, or a quantized cache (int8, float8_e4m3fn, float8_e5m2 codes;
``asyncpaged.model.kv_quant``) with its bfloat16 scales ``key_scale`` / ``value_scale``
``[num_blocks, Hkv, block_size]`` passed beside it; the kernels decode the codes in registers.
"""

from __future__ import annotations

import ctypes
import math
from typing import Final

import torch

from .cpu_build import load_library

SUPPORTED_HEAD_DIMS: Final = frozenset({16, 32, 64, 80, 96, 128, 256})
# The library's float dtypes (activations, and unquantized caches).
KV_DTYPE_CODES: Final = {torch.float32: 0, torch.bfloat16: 1}
# The cache dtypes the attention kernels and the cache write take (csrc/cpu_vec.h CacheDtype):
# the float ones, and quantized codes that come with bfloat16 scales.
QUANTIZED_CACHE_CODES: Final = {torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
CACHE_DTYPE_CODES: Final = {**KV_DTYPE_CODES, **QUANTIZED_CACHE_CODES}
BLOCK_SIZE_MULTIPLE: Final = 16
# Prefill tiling: query rows per work item come from the score rows wanted per tile (query rows x
# query heads per KV head); cache blocks per online-softmax step (<= 0: two passes per tile).
# Measured at 1 thread (8/2 heads x 64): 32 or 64 score rows alike, 128 up to 2x slower at 2048
# keys (the two-pass scores leave L2); key tiles of 32 blocks as fast as two-pass (+-2%) with
# bounded scratch, 8 blocks 1.05-1.08x, 4 blocks 1.1-1.16x, 1 block 1.45-1.55x the time.
PREFILL_TILE_SCORE_ROWS: Final = 32
PREFILL_KEY_TILE_BLOCKS: Final = 32
_STATUS_MESSAGES: Final = {
    1: "head_dim is not supported by this build",
    2: "block_size must be a multiple of 16",
    3: "num_heads must be a multiple of num_kv_heads",
    4: "a context length is < 1, shorter than its new rows, or longer than its block table",
    5: "a block table entry in use is outside [0, num_blocks)",
    6: "the KV cache dtype must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2",
    7: "a sequence index, query row or slot is out of range",
    8: "a quantized KV cache needs its key and value scales",
}


def rows_dense(t: torch.Tensor) -> bool:
    """[N, H, D] whose rows [H, D] are contiguous (the row stride may be larger)."""
    stride = t.stride()
    return len(stride) == 3 and stride[2] == 1 and stride[1] == t.shape[2]


def status_message(status: int) -> str:
    return _STATUS_MESSAGES.get(status, str(status))


def check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """The checks every attention entry point makes (raises ``ValueError``)."""
    tensors = (query, key_cache, value_cache, block_tables, context_lens)
    if not (query.is_cpu and key_cache.is_cpu and value_cache.is_cpu and block_tables.is_cpu
            and context_lens.is_cpu):  # fmt: skip
        raise ValueError(f"all tensors must be on the CPU, got {[str(t.device) for t in tensors]}.")
    if query.dtype != torch.float32 or not rows_dense(query):
        raise ValueError(
            f"query must be float32 [S, Hq, D] with contiguous [Hq, D] rows, got {query.dtype} "
            f"{tuple(query.shape)} strides {query.stride()}."
        )
    _, num_heads, head_dim = query.shape
    check_cache(key_cache, value_cache, head_dim, key_scale, value_scale)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {sorted(SUPPORTED_HEAD_DIMS)}, got {head_dim}.")
    _, kv_heads, _, block_size = key_cache.shape
    if block_size % BLOCK_SIZE_MULTIPLE != 0:
        raise ValueError(f"block_size must be a multiple of 16, got {block_size}.")
    if num_heads % kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_heads})."
        )
    if block_tables.dtype != torch.int64 or block_tables.stride()[1:] != (1,):
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
    if softcap is not None and not (0.0 < softcap < math.inf):
        raise ValueError(f"softcap must be > 0 and finite, or None, got {softcap}.")


def check_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    head_dim: int,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """key_cache [num_blocks, Hkv, D, bs], value_cache [num_blocks, Hkv, bs, D], contiguous, of
    one dtype in ``CACHE_DTYPE_CODES``; a quantized one with contiguous bfloat16 key_scale /
    value_scale [num_blocks, Hkv, bs] on the CPU, any other without."""
    key_shape, value_shape = key_cache.shape, value_cache.shape
    if len(key_shape) != 4 or len(value_shape) != 4:
        raise ValueError(
            f"key_cache/value_cache must be 4-D, got {tuple(key_shape)} and {tuple(value_shape)}."
        )
    num_blocks, kv_heads, key_dim, block_size = key_shape
    if key_dim != head_dim or value_shape != (num_blocks, kv_heads, block_size, head_dim):
        raise ValueError(
            "expected key_cache [num_blocks, Hkv, D, block_size] and value_cache [num_blocks, "
            f"Hkv, block_size, D] with D = {head_dim}, got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}."
        )
    if key_cache.dtype not in CACHE_DTYPE_CODES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            "the KV cache must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2 (both "
            f"the same), got {key_cache.dtype} and {value_cache.dtype}."
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous.")
    if key_cache.dtype not in QUANTIZED_CACHE_CODES:
        if key_scale is not None or value_scale is not None:
            raise ValueError(f"a {key_cache.dtype} KV cache takes no scales.")
        return
    for name, t in (("key_scale", key_scale), ("value_scale", value_scale)):
        if t is None:
            raise ValueError(f"a {key_cache.dtype} KV cache needs key_scale and value_scale.")
        if not (t.shape == (num_blocks, kv_heads, block_size) and t.dtype == torch.bfloat16
                and t.is_cpu and t.is_contiguous()):  # fmt: skip
            raise ValueError(
                f"{name} must be contiguous bfloat16 [{num_blocks}, {kv_heads}, {block_size}] "
                f"on the CPU, got {t.dtype} {tuple(t.shape)} on {t.device}."
            )


def library_or_raise(target: str | None) -> ctypes.CDLL:
    """The kernel library, or ``RuntimeError`` saying why there is none."""
    lib = load_library(target)
    if lib is None:
        raise RuntimeError(
            "the CPU paged-attention kernel is unavailable (no g++ or the build failed, see the "
            "cpu_kernel_unavailable log event); use TorchAttentionBackend instead."
        )
    return lib


def default_query_tile(group: int) -> int:
    """Query rows per prefill work item for ``group`` query heads per KV head."""
    return max(1, PREFILL_TILE_SCORE_ROWS // group)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    seq_indices: torch.Tensor | None = None,
    num_threads: int | None = None,
    target: str | None = None,
    query_tile: int | None = None,
    key_tile_blocks: int = PREFILL_KEY_TILE_BLOCKS,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new query rows of sequences ``seq_indices`` (default: all) over their
    cached context; other rows of ``out`` are left as they are.

    query [T, Hq, D] float32 (sequence ``i`` owns rows ``query_start_loc[i]:[i+1]``); key_cache
    / value_cache and block_tables as for ``paged_decode_attention``; query_start_loc [S+1] and
    context_lens [S] int64 (cached + new tokens) -> out [T, Hq, D] float32; ``softcap``: Gemma 2's
    logit softcapping (None: none). ``query_tile`` (rows
    per work item, default ``default_query_tile``) and ``key_tile_blocks`` (<= 0: two-pass) tune
    the tiling; ``num_threads`` defaults to ``torch.get_num_threads()``; ``key_scale`` /
    ``value_scale``: a quantized cache's scales [num_blocks, Hkv, bs] bfloat16.
    """
    check_inputs(query, key_cache, value_cache, block_tables, context_lens, sliding_window, softcap,
                 key_scale, value_scale)  # fmt: skip
    num_seqs = block_tables.shape[0]
    if context_lens.shape[0] != num_seqs or tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(
            f"context_lens needs {num_seqs} rows and query_start_loc {num_seqs + 1} (one per "
            f"block table row), got {tuple(context_lens.shape)} and "
            f"{tuple(query_start_loc.shape)}."
        )
    if query_start_loc.dtype != torch.int64 or query_start_loc.device.type != "cpu":
        raise ValueError(f"query_start_loc must be int64 on the CPU, got {query_start_loc.dtype}.")
    if seq_indices is None:
        seq_indices = torch.arange(num_seqs, dtype=torch.int64)
    if out is None:
        out = torch.empty(query.shape, dtype=torch.float32)
    elif out.shape != query.shape or out.dtype != torch.float32 or not rows_dense(out):
        raise ValueError(
            f"out must be float32 of shape {tuple(query.shape)} with contiguous [Hq, D] rows, "
            f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}."
        )
    if query_tile is not None and query_tile < 1:
        raise ValueError(f"query_tile must be >= 1, got {query_tile}.")
    launch_prefill(
        library_or_raise(target), out, query, key_cache, value_cache, block_tables, query_start_loc,
        context_lens, seq_indices, scale, sliding_window, num_threads,
        softcap=softcap, query_tile=query_tile, key_tile_blocks=key_tile_blocks,
        key_scale=key_scale, value_scale=value_scale,
    )  # fmt: skip
    return out


def launch_prefill(
    lib: ctypes.CDLL,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    seq_indices: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_threads: int | None,
    *,
    softcap: float | None = None,
    query_tile: int | None = None,
    key_tile_blocks: int = PREFILL_KEY_TILE_BLOCKS,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Call the prefill kernel on checked inputs (every index is checked again in C++)."""
    context_lens, query_start_loc = context_lens.contiguous(), query_start_loc.contiguous()
    seq_indices = seq_indices.contiguous()
    num_blocks, kv_heads, head_dim, block_size = key_cache.shape
    num_heads = query.shape[1]
    if query_tile is None:
        query_tile = default_query_tile(num_heads // kv_heads)
    status = lib.asyncpaged_paged_prefill(
        out.data_ptr(), out.stride(0),
        query.data_ptr(), query.stride(0), query.shape[0],
        key_cache.data_ptr(), value_cache.data_ptr(), _ptr(key_scale), _ptr(value_scale),
        CACHE_DTYPE_CODES[key_cache.dtype], num_blocks, kv_heads, head_dim, block_size,
        block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
        block_tables.shape[0],
        context_lens.data_ptr(), query_start_loc.data_ptr(), seq_indices.data_ptr(),
        seq_indices.numel(), num_heads, scale, sliding_window or 0, softcap or 0.0,
        query_tile, key_tile_blocks,
        torch.get_num_threads() if num_threads is None else num_threads,
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"paged prefill attention refused its inputs: {status_message(status)}.")


def reference_paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in float64 for every sequence (masked softmax): [T, Hq, D]; a
    quantized cache's blocks are dequantized as they are gathered (``gather_blocks_f64``)."""
    num_tokens, num_heads, head_dim = query.shape
    _, kv_heads, _, block_size = key_cache.shape
    group = num_heads // kv_heads
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    for i in range(block_tables.shape[0]):
        start, end, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(context_lens[i])
        blocks = block_tables[i, : -(-ctx // block_size)]
        keys, values = gather_blocks_f64(key_cache, value_cache, blocks, key_scale, value_scale)
        keys = keys.permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
        values = values.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)
        keys, values = keys[:, :ctx], values[:, :ctx]  # [Hkv, ctx, D]
        q_pos = torch.arange(ctx - (end - start), ctx)[:, None]  # [q, 1]
        k_pos = torch.arange(ctx)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        q = query[start:end].double().view(-1, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = (q @ keys[:, None].transpose(2, 3)) * scale  # [Hkv, G, q, ctx]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        o = probs @ values[:, None]  # [Hkv, G, q, D]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(end - start, num_heads, head_dim)
    assert out.shape == (num_tokens, num_heads, head_dim)
    return out


def gather_blocks_f64(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``blocks`` of the cache in float64, K [n, Hkv, D, bs] and V [n, Hkv, bs, D]; a
    quantized cache's codes times their token's scales (exact: so are the kernels' fp32
    products of a one-byte code and a bfloat16 scale)."""
    keys, values = key_cache[blocks].double(), value_cache[blocks].double()
    if key_scale is not None and value_scale is not None:
        keys = keys * key_scale[blocks].double()[:, :, None, :]
        values = values * value_scale[blocks].double()[..., None]
    return keys, values


def paged_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    num_threads: int | None = None,
    target: str | None = None,
) -> None:
    """``PagedKVCache.write`` for one layer's views: key/value [T, Hkv, D] (float32 or bfloat16,
    contiguous [Hkv, D] rows) into slots [T] int64 (negative: skipped), rounded as torch rounds;
    into a quantized cache, codes and the scales ``key_scale`` / ``value_scale`` [num_blocks,
    Hkv, bs] as ``kv_quant.quantize`` computes them (bit for bit, for finite rows)."""
    check_cache(key_cache, value_cache, key_cache.shape[2], key_scale, value_scale)
    num_tokens = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in KV_DTYPE_CODES or not rows_dense(t) or t.device.type != "cpu":
            raise ValueError(
                f"{name} must be float32 or bfloat16 [T, Hkv, D] on the CPU with contiguous "
                f"[Hkv, D] rows, got {t.dtype} {tuple(t.shape)} strides {t.stride()}."
            )
        if tuple(t.shape) != (num_tokens, key_cache.shape[1], key_cache.shape[2]):
            raise ValueError(
                f"{name} must be [{num_tokens}, {key_cache.shape[1]}, {key_cache.shape[2]}] "
                f"(one row per slot), got {tuple(t.shape)}."
            )
    if slot_mapping.dtype != torch.int64 or key.dtype != value.dtype:
        raise ValueError(
            f"slot_mapping must be int64 and key/value one dtype, got {slot_mapping.dtype}, "
            f"{key.dtype} and {value.dtype}."
        )
    lib = library_or_raise(target)
    launch_write(
        lib, key, value, key_cache, value_cache, slot_mapping, num_threads, key_scale, value_scale
    )


def launch_write(
    lib: ctypes.CDLL,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_threads: int | None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Call the cache write on checked inputs (every slot is checked again in C++)."""
    slot_mapping = slot_mapping.contiguous()
    num_blocks, kv_heads, head_dim, block_size = key_cache.shape
    status = lib.asyncpaged_cache_write(
        key_cache.data_ptr(), value_cache.data_ptr(), _ptr(key_scale), _ptr(value_scale),
        CACHE_DTYPE_CODES[key_cache.dtype],
        num_blocks, kv_heads, head_dim, block_size,
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), KV_DTYPE_CODES[key.dtype],
        slot_mapping.data_ptr(), slot_mapping.shape[0],
        torch.get_num_threads() if num_threads is None else num_threads,
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"the KV cache write refused its inputs: {status_message(status)}.")


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for ctypes, or None (a null pointer)."""
    return None if t is None else t.data_ptr()
