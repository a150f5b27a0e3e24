"""Attention over the paged KV cache, behind a small backend interface.

A step's tokens form one flat batch with no padding: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step's K/V are written, has
``context_lens[i]`` tokens in the cache (its cached prefix plus the new ones). The new query row
``j`` of a sequence sits at position ``context_len - query_len + j`` and sees keys ``0..`` that
position (the causal offset for the cached part), within the sliding window when the layer has one.

``TorchAttentionBackend`` is the portable CPU path. Decodes (one new token) are sorted by context
length and attended in groups of ``decode_group_size`` (little padding inside a group): a group's
blocks are gathered with ``index_select`` into a reused workspace and attended block by block,
with no re-layout copy of K or V (see ``_decode_group``). Every other sequence (prefill or a
prefill chunk) gets its own SDPA over its gathered prefix + chunk. Query heads are packed per KV
head (``q.view(kv_heads, group, ...)``), so K/V heads are never repeated, and no mask ever spans
two requests. A quantized cache (int8, fp8: ``kv_quant``) is dequantized as its blocks are
gathered (codes times their per-token scales, float32), before any score is computed. A C++ or
Triton backend plugs in by implementing ``AttentionBackend.forward``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from asyncpaged.model.kv_cache import KVLayout, PagedKVCache, SlotTargets


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionMetadata:
    """Per-step attention inputs: tensors on the model's device, ``*_host`` Python copies."""

    query_start_loc: torch.Tensor  # [S+1] int64, cu_seqlens of the new tokens
    context_lens: torch.Tensor  # [S] int64, cached + new tokens per sequence
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with block 0 (never read)
    block_tables_host: np.ndarray  # the same, on the host
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write
    # [T] int64: the sequence length each token's RoPE scaling is chosen for (dynamic,
    # longrope): its sequence's context length after the step, or more (``rope_lens``)
    token_rope_lens: torch.Tensor
    query_start_loc_host: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    decode_indices: tuple[int, ...]  # sequences with exactly one new token
    prefill_indices: tuple[int, ...]  # sequences with more than one new token
    slot_targets: SlotTargets  # slot_mapping split by block_size (the K/V write)
    block_size: int

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int] | np.ndarray,
        context_lens: Sequence[int] | np.ndarray,
        block_tables: Sequence[Sequence[int]] | np.ndarray,
        slot_mapping: Sequence[int] | np.ndarray,
        device: torch.device,
        block_size: int = 16,
        rope_lens: Sequence[int] | np.ndarray | None = None,
    ) -> AttentionMetadata:
        """``block_tables``: one table per sequence, or an ``[S, max_blocks]`` int64 array
        padded with block 0 (the runner's persistent tables, ``worker/input_batch``)."""
        qlens = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        starts = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens, out=starts[1:])
        if isinstance(block_tables, np.ndarray):
            tables = block_tables
        else:
            width = max(map(len, block_tables), default=0) or 1
            tables = np.zeros((len(block_tables), width), dtype=np.int64)
            for i, table in enumerate(block_tables):
                tables[i, : len(table)] = table
        slots = torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(device)
        rope = ctx if rope_lens is None else np.asarray(rope_lens, dtype=np.int64)
        decodes = qlens == 1
        return cls(
            query_start_loc=torch.from_numpy(starts).to(device),
            context_lens=torch.from_numpy(ctx).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            block_tables_host=tables,
            slot_mapping=slots,
            slot_targets=SlotTargets.of(slots, block_size),
            block_size=block_size,
            token_rope_lens=torch.from_numpy(np.repeat(rope, qlens)).to(device),
            query_start_loc_host=tuple(starts.tolist()),
            context_lens_host=tuple(ctx.tolist()),
            decode_indices=tuple(np.flatnonzero(decodes).tolist()),
            prefill_indices=tuple(np.flatnonzero(~decodes & (qlens > 1)).tolist()),
        )


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it."""

    #: Whether a CUDA graph can capture ``forward``: it reads only device tensors and the host
    #: facts a decode bucket fixes (``cuda_graphs``), and allocates nothing from the host.
    graph_safe: ClassVar[bool] = False
    #: The cache layout the runner allocates for this backend (``kv_cache``): the one its
    #: kernels read fastest. The CPU and torch paths read "runner" only.
    kv_layout: KVLayout = "runner"

    def pin_metadata(self, metadata: AttentionMetadata) -> None:
        """Keep what ``forward`` builds for ``metadata`` (kept by a CUDA graph, which replays
        it) alive as long as this backend; nothing by default."""
        del metadata  # nothing built per metadata here

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
        softcap: float | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> attention output [T, Hq, D].

        Scores are ``scale * q.k``; with ``softcap`` (Gemma 2's attention logit softcapping)
        they become ``softcap * tanh(scores / softcap)`` before masking and the softmax."""

    def copy_blocks(self, kv_cache: PagedKVCache, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write before a step: block ``src`` onto ``dst`` in every layer."""
        kv_cache.copy_blocks(pairs)


def _write(
    kv_cache: PagedKVCache,
    layer_idx: int,
    key: torch.Tensor,
    value: torch.Tensor,
    md: AttentionMetadata,
) -> None:
    """The layer's K/V write, with the step's precomputed targets when they fit the cache."""
    targets = md.slot_targets
    if kv_cache.block_size != md.block_size:
        targets = SlotTargets.of(md.slot_mapping, kv_cache.block_size)
    kv_cache.write_targets(layer_idx, key, value, targets)


@dataclass(frozen=True, slots=True, kw_only=True)
class _DecodeGroup:
    """Layer-independent inputs of one group of decodes (built once per step).

    Padding (positions past a sequence's context, or before its sliding window) is listed by
    flat index: ``score_pad`` into the scores ``[Hkv, n, G, L]``, ``value_pad_rows`` into the
    gathered V viewed as rows ``[Hkv * n * L, D]``.
    """

    rows: torch.Tensor  # [n] int64, the query/output row of each sequence
    blocks: torch.Tensor  # [n * nb] int64, block tables padded to nb with block 0
    num_blocks: int  # nb; L = nb * block_size
    score_pad: torch.Tensor | None  # [P * Hkv * G] int64; None = no padding
    value_pad_rows: torch.Tensor | None  # [P * Hkv] int64


class TorchAttentionBackend(AttentionBackend):
    """Pure torch CPU path (float32 math; see the module docstring).

    Holds per-step decode plans (derived from the last metadata seen, reused by every layer) and
    a gather workspace that grows to the largest group and is reused.
    """

    def __init__(self, decode_group_size: int = 8) -> None:
        if decode_group_size <= 0:
            raise ValueError(f"decode_group_size must be > 0, got {decode_group_size}.")
        self.decode_group_size = decode_group_size
        self._plan_metadata: AttentionMetadata | None = None  # kept alive: identity is the key
        self._plans: dict[tuple[int, int, int | None], tuple[_DecodeGroup, ...]] = {}
        self._workspace = torch.empty(0)

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
        softcap: float | None = None,
    ) -> torch.Tensor:
        assert kv_cache.layout == "runner", (
            f"the torch path reads the runner layout, not {kv_cache.layout}"
        )
        _write(kv_cache, layer_idx, key, value, metadata)
        key_cache, value_cache = kv_cache.layer(layer_idx)
        scales = kv_cache.layer_scales(layer_idx)
        out = torch.empty_like(query)  # [T, Hq, D]
        if metadata.decode_indices:
            group_heads = query.shape[1] // key_cache.shape[1]
            groups = self._decode_plan(metadata, key_cache, group_heads, sliding_window)
            workspace = self._gather_workspace(groups, key_cache)
            for group in groups:
                _decode_group(
                    group, out, query, key_cache, value_cache, workspace, scale, softcap, scales
                )
        for i in metadata.prefill_indices:
            _prefill_one(
                i, out, query, key_cache, value_cache, metadata, scale, sliding_window, softcap,
                scales,
            )  # fmt: skip
        return out

    def _decode_plan(
        self,
        md: AttentionMetadata,
        key_cache: torch.Tensor,
        group_heads: int,
        sliding_window: int | None,
    ) -> tuple[_DecodeGroup, ...]:
        if md is not self._plan_metadata:
            self._plan_metadata, self._plans = md, {}
        kv_heads, block_size = key_cache.shape[1], key_cache.shape[-1]
        key = (group_heads, block_size, sliding_window)
        if key not in self._plans:
            self._plans[key] = _plan_decode_groups(
                md,
                self.decode_group_size,
                kv_heads=kv_heads,
                group_heads=group_heads,
                block_size=block_size,
                window=sliding_window,
            )
        return self._plans[key]

    def _gather_workspace(
        self, groups: tuple[_DecodeGroup, ...], key_cache: torch.Tensor
    ) -> torch.Tensor:
        """One buffer for a group's gathered K then V (block numel = K block = V block)."""
        block_numel = key_cache[0].numel()
        needed = 2 * max(g.blocks.numel() for g in groups) * block_numel
        ws = self._workspace
        if ws.numel() < needed or ws.dtype != key_cache.dtype or ws.device != key_cache.device:
            ws = torch.empty(needed, dtype=key_cache.dtype, device=key_cache.device)
            self._workspace = ws
        return ws


def _plan_decode_groups(
    md: AttentionMetadata,
    group_size: int,
    *,
    kv_heads: int,
    group_heads: int,
    block_size: int,
    window: int | None,
) -> tuple[_DecodeGroup, ...]:
    """Sort decodes by context length and cut them into groups of at most ``group_size``."""
    order = sorted(md.decode_indices, key=lambda i: md.context_lens_host[i])
    device = md.block_tables.device
    groups = []
    for start in range(0, len(order), group_size):
        members = order[start : start + group_size]
        lens = [md.context_lens_host[i] for i in members]
        num_seqs, num_blocks = len(members), -(-max(lens) // block_size)
        length = num_blocks * block_size
        idx = torch.tensor(members, dtype=torch.int64, device=device)
        score_pad, value_pad_rows = None, None
        if window is not None or min(lens) < length:
            ctx = md.context_lens[idx][:, None]  # [n, 1]
            key_pos = torch.arange(length, device=device)[None, :]  # [1, L]
            invalid = key_pos >= ctx  # [n, L]
            if window is not None:
                invalid |= key_pos <= ctx - 1 - window
            seq, pos = torch.nonzero(invalid, as_tuple=True)  # [P]
            head = torch.arange(kv_heads, device=device)[:, None]  # [Hkv, 1]
            value_pad_rows = ((head * num_seqs + seq) * length + pos).reshape(-1)  # [Hkv * P]
            qhead = torch.arange(kv_heads * group_heads, device=device)[:, None]  # [Hkv*G, 1]
            kv, g = qhead // group_heads, qhead % group_heads
            score_pad = (((kv * num_seqs + seq) * group_heads + g) * length + pos).reshape(-1)
        groups.append(
            _DecodeGroup(
                rows=md.query_start_loc[idx],
                blocks=md.block_tables[idx, :num_blocks].reshape(-1),
                num_blocks=num_blocks,
                score_pad=score_pad,
                value_pad_rows=value_pad_rows,
            )
        )
    return tuple(groups)


def _decode_group(
    group: _DecodeGroup,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    workspace: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attention of one decode group over its gathered blocks, with no re-layout copy of K/V.

    K (stored ``[Hkv, D, bs]`` per block) is used block by block: the scores are one batched
    matmul of the packed query heads against every gathered K block. V is gathered one KV head
    at a time (``value_cache[:, h]`` rows are ``[bs, D]``), which lays each sequence's V out
    contiguously as ``[L, D]``: the output is one batched ``probs @ V``. ``scales``: a quantized
    cache's K and V scales ``[num_blocks, Hkv, bs]``, which dequantize the gathered codes.
    """
    num_seqs, nb = group.rows.numel(), group.num_blocks
    _, kv_heads, head_dim, block_size = key_cache.shape
    length = nb * block_size
    size = group.blocks.numel() * key_cache[0].numel()
    keys = torch.index_select(
        key_cache, 0, group.blocks, out=workspace[:size].view(-1, kv_heads, head_dim, block_size)
    ).view(num_seqs, nb, kv_heads, head_dim, block_size)
    values = workspace[size : 2 * size].view(kv_heads, -1, block_size, head_dim)
    for h in range(kv_heads):
        torch.index_select(value_cache[:, h], 0, group.blocks, out=values[h])
    if scales is not None:
        key_scale = scales[0].index_select(0, group.blocks).float()  # [n * nb, Hkv, bs]
        keys = keys.float() * key_scale.view(num_seqs, nb, kv_heads, 1, block_size)
        value_scale = scales[1].index_select(0, group.blocks).float()  # [n * nb, Hkv, bs]
        values = values.float() * value_scale.transpose(0, 1)[..., None]  # [Hkv, n * nb, bs, D]
    if group.value_pad_rows is not None:
        # Unwritten or foreign slots may hold anything (NaN in tests): 0 * NaN would leak.
        values.view(-1, head_dim).index_fill_(0, group.value_pad_rows, 0.0)
    values = values.view(kv_heads, num_seqs, length, head_dim)
    if keys.dtype != torch.float32:
        keys, values = keys.float(), values.float()
    q = query[group.rows].float().view(num_seqs, 1, kv_heads, -1, head_dim) * scale
    scores = torch.matmul(q, keys)  # [n, nb, Hkv, G, bs]
    group_heads = scores.shape[3]
    scores = scores.permute(2, 0, 3, 1, 4).contiguous()  # [Hkv, n, G, nb, bs]
    scores = scores.view(kv_heads, num_seqs, group_heads, length)
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    if group.score_pad is not None:
        scores.view(-1).index_fill_(0, group.score_pad, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Hkv, n, G, L]
    o = torch.matmul(probs, values)  # [Hkv, n, G, D]
    o = o.permute(1, 0, 2, 3).reshape(num_seqs, -1, head_dim)  # [n, Hq, D]
    out.index_copy_(0, group.rows, o.to(out.dtype))


def _gather(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [B, nb] -> K, V [B, kv_heads, nb * block_size, D] in float32 (dequantized with
    ``scales``, a quantized cache's K and V scales [num_blocks, Hkv, bs])."""
    num_seqs, num_blocks = blocks.shape
    flat = blocks.reshape(-1)
    keys = key_cache.index_select(0, flat)  # [B*nb, Hkv, D, bs]
    values = value_cache.index_select(0, flat)  # [B*nb, Hkv, bs, D]
    if scales is not None:
        keys = keys.float() * scales[0].index_select(0, flat).float()[:, :, None, :]
        values = values.float() * scales[1].index_select(0, flat).float()[..., None]
    _, kv_heads, head_dim, block_size = keys.shape
    keys = keys.view(num_seqs, num_blocks, kv_heads, head_dim, block_size)
    keys = keys.permute(0, 2, 1, 4, 3).reshape(num_seqs, kv_heads, -1, head_dim)
    values = values.view(num_seqs, num_blocks, kv_heads, block_size, head_dim)
    values = values.permute(0, 2, 1, 3, 4).reshape(num_seqs, kv_heads, -1, head_dim)
    return keys.float(), values.float()


def _prefill_one(
    i: int,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    block_size = key_cache.shape[-1]
    start, end = md.query_start_loc_host[i], md.query_start_loc_host[i + 1]
    q_len, ctx = end - start, md.context_lens_host[i]
    num_blocks = -(-ctx // block_size)
    tables = md.block_tables[i : i + 1, :num_blocks]
    keys, values = _gather(key_cache, value_cache, tables, scales)
    keys, values = keys[0, :, :ctx], values[0, :, :ctx]  # [Hkv, ctx, D]
    kv_heads, head_dim = keys.shape[0], keys.shape[-1]
    group = query.shape[1] // kv_heads
    q = query[start:end].float().view(q_len, kv_heads, group, head_dim)
    q = q.permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, head_dim)  # [Hkv, G*q, D]
    if q_len == ctx and sliding_window is None and softcap is None:
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
        if softcap is None:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        else:  # SDPA has no softcap: the scores in the open
            scores = torch.tanh(q @ keys.transpose(1, 2) * (scale / softcap)) * softcap
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            o = probs @ values  # [Hkv, G*q, D]
    o = o.reshape(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)  # [q, Hkv, G, D]
    out[start:end] = o.reshape(q_len, -1, head_dim).to(out.dtype)
