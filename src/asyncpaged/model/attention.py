"""Attention over the paged KV cache, behind a small backend interface.

A step's tokens form one flat batch with no padding: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step's K/V are written, has
``context_lens[i]`` tokens in the cache (its cached prefix plus the new ones). The new query row
``j`` of a sequence sits at position ``context_len - query_len + j`` and sees keys ``0..`` that
position (the causal offset for the cached part), within the sliding window when the layer has one.

``TorchAttentionBackend`` is the portable CPU path: sequences with one new token (decodes) are
attended together as one batched SDPA over their gathered blocks with a per-row length mask; every
other sequence (prefill or a prefill chunk) gets its own SDPA over its gathered prefix + chunk.
Query heads are packed per KV head (``q.view(kv_heads, group, ...)``), so K/V heads are never
repeated, and no mask ever spans two requests. A C++ or Triton backend plugs in by implementing
``AttentionBackend.forward``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncpaged.model.kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionMetadata:
    """Per-step attention inputs: tensors on the model's device, ``*_host`` Python copies."""

    query_start_loc: torch.Tensor  # [S+1] int64, cu_seqlens of the new tokens
    context_lens: torch.Tensor  # [S] int64, cached + new tokens per sequence
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with block 0 (never read)
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write
    token_context_lens: torch.Tensor  # [T] int64, context_lens of each token's sequence
    query_start_loc_host: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    decode_indices: tuple[int, ...]  # sequences with exactly one new token
    prefill_indices: tuple[int, ...]  # sequences with more than one new token

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: Sequence[int],
        device: torch.device,
    ) -> AttentionMetadata:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        lens = torch.tensor(list(context_lens), dtype=torch.int64)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            context_lens=lens.to(device),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device).view(-1, width),
            slot_mapping=torch.tensor(list(slot_mapping), dtype=torch.int64, device=device),
            token_context_lens=torch.repeat_interleave(
                lens, torch.tensor(list(query_lens), dtype=torch.int64)
            ).to(device),
            query_start_loc_host=tuple(starts),
            context_lens_host=tuple(context_lens),
            decode_indices=tuple(i for i, n in enumerate(query_lens) if n == 1),
            prefill_indices=tuple(i for i, n in enumerate(query_lens) if n > 1),
        )


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it."""

    @abstractmethod
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
        """query [T, Hq, D], key/value [T, Hkv, D] -> attention output [T, Hq, D]."""


class TorchAttentionBackend(AttentionBackend):
    """Pure torch CPU path (float32 math; see the module docstring)."""

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
        kv_cache.write(layer_idx, key, value, metadata.slot_mapping)
        key_cache, value_cache = kv_cache.layer(layer_idx)
        out = torch.empty_like(query)  # [T, Hq, D]
        if metadata.decode_indices:
            _decode(out, query, key_cache, value_cache, metadata, scale, sliding_window)
        for i in metadata.prefill_indices:
            _prefill_one(i, out, query, key_cache, value_cache, metadata, scale, sliding_window)
        return out


def _gather(
    key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [B, nb] -> K, V [B, kv_heads, nb * block_size, D] in float32."""
    num_seqs, num_blocks = blocks.shape
    flat = blocks.reshape(-1)
    keys = key_cache.index_select(0, flat)  # [B*nb, Hkv, D, bs]
    values = value_cache.index_select(0, flat)  # [B*nb, Hkv, bs, D]
    _, kv_heads, head_dim, block_size = keys.shape
    keys = keys.view(num_seqs, num_blocks, kv_heads, head_dim, block_size)
    keys = keys.permute(0, 2, 1, 4, 3).reshape(num_seqs, kv_heads, -1, head_dim)
    values = values.view(num_seqs, num_blocks, kv_heads, block_size, head_dim)
    values = values.permute(0, 2, 1, 3, 4).reshape(num_seqs, kv_heads, -1, head_dim)
    return keys.float(), values.float()


def _decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> None:
    block_size = key_cache.shape[-1]
    idx = torch.tensor(md.decode_indices, dtype=torch.int64, device=query.device)
    rows = md.query_start_loc[idx]  # [B] token row of each decode
    ctx = md.context_lens[idx]  # [B]
    max_ctx = max(md.context_lens_host[i] for i in md.decode_indices)
    num_blocks = -(-max_ctx // block_size)
    keys, values = _gather(key_cache, value_cache, md.block_tables[idx, :num_blocks])
    length = keys.shape[2]
    key_pos = torch.arange(length, device=query.device)[None, :]  # [1, L]
    valid = key_pos < ctx[:, None]  # [B, L]
    if sliding_window is not None:
        valid &= key_pos > (ctx[:, None] - 1 - sliding_window)
    # Unwritten or foreign slots may hold anything (NaN in tests): zero them, then mask them.
    keys = keys.masked_fill(~valid[:, None, :, None], 0.0)
    values = values.masked_fill(~valid[:, None, :, None], 0.0)
    num_seqs, kv_heads = keys.shape[0], keys.shape[1]
    q = query[rows].float().view(num_seqs, kv_heads, -1, query.shape[-1])  # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=valid[:, None, None, :], scale=scale
    )  # [B, Hkv, G, D]
    out[rows] = o.reshape(num_seqs, -1, query.shape[-1]).to(out.dtype)


def _prefill_one(
    i: int,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> None:
    block_size = key_cache.shape[-1]
    start, end = md.query_start_loc_host[i], md.query_start_loc_host[i + 1]
    q_len, ctx = end - start, md.context_lens_host[i]
    num_blocks = -(-ctx // block_size)
    keys, values = _gather(key_cache, value_cache, md.block_tables[i : i + 1, :num_blocks])
    keys, values = keys[0, :, :ctx], values[0, :, :ctx]  # [Hkv, ctx, D]
    kv_heads, head_dim = keys.shape[0], keys.shape[-1]
    group = query.shape[1] // kv_heads
    q = query[start:end].float().view(q_len, kv_heads, group, head_dim)
    q = q.permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, head_dim)  # [Hkv, G*q, D]
    if q_len == ctx and sliding_window is None:
        o = F.scaled_dot_product_attention(
            q.view(kv_heads, group, q_len, head_dim),
            keys[:, None],
            values[:, None],
            is_causal=True,
            scale=scale,
        )  # [Hkv, G, q, D]
    else:
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]  # [q, 1]
        k_pos = torch.arange(ctx, device=query.device)[None, :]  # [1, ctx]
        mask = k_pos <= q_pos  # [q, ctx]
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        mask = mask.expand(group, q_len, ctx).reshape(group * q_len, ctx)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    o = o.reshape(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)  # [q, Hkv, G, D]
    out[start:end] = o.reshape(q_len, -1, head_dim).to(out.dtype)
