"""Random paged-cache cases: NaN-poisoned caches, scattered block tables, random K/V/query.

A case holds a pool of ``num_blocks`` blocks (block 0 is the never-written null block). Each
sequence gets distinct blocks drawn at random from the pool, in random order; its block-table row
is padded with block 0 past its last block and the table has spare columns, so a wrong row stride
reads someone else's (or the null) block. Every slot not holding a token stays NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["runner", "nhd"]
PAGE = 16
NUM_BLOCKS = 4096

TOLERANCE = {
    torch.float32: 2e-5,
    torch.float16: 3e-3,
    torch.bfloat16: 2e-2,
}


def make_cache(
    layout: Layout,
    num_blocks: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_layers: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, V) physical all-layer tensors and (K, V) logical views of layer 0, all NaN."""
    nan = float("nan")
    if layout == "runner":
        key = torch.full((num_layers, num_blocks, kv_heads, head_dim, PAGE), nan, dtype=dtype)
        value = torch.full((num_layers, num_blocks, kv_heads, PAGE, head_dim), nan, dtype=dtype)
        key, value = key.to(device), value.to(device)
        return key, value, key[0].permute(0, 3, 1, 2), value[0].permute(0, 2, 1, 3)
    kv = torch.full((num_layers, num_blocks, 2, PAGE, kv_heads, head_dim), nan, dtype=dtype)
    kv = kv.to(device)
    return kv[:, :, 0], kv[:, :, 1], kv[0, :, 0], kv[0, :, 1]


@dataclass
class PagedCase:
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # logical [blocks, PAGE, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, width] int64
    query_start_loc: torch.Tensor  # [S+1] int64
    context_lens: torch.Tensor  # [S] int64
    query_lens: list[int]
    context_lens_host: list[int]
    slot_mapping: torch.Tensor  # [T] int64, slots of the new tokens
    new_key: torch.Tensor  # [T, Hkv, D], the K/V of the new tokens
    new_value: torch.Tensor


def make_case(
    *,
    query_lens: list[int],
    context_lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    layout: Layout = "runner",
    seed: int = 0,
    write_new: bool = True,
) -> PagedCase:
    """Cached prefixes written; the new tokens' K/V written too when ``write_new``."""
    gen = torch.Generator().manual_seed(seed)
    _, _, key_cache, value_cache = make_cache(layout, NUM_BLOCKS, kv_heads, head_dim, dtype, device)
    pool = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    width = max(-(-c // PAGE) for c in context_lens) + 3
    tables: list[list[int]] = []
    slots: list[int] = []
    cached: list[int] = []
    for q_len, ctx in zip(query_lens, context_lens, strict=True):
        assert 0 < q_len <= ctx
        num = -(-ctx // PAGE)
        blocks, pool = pool[:num], pool[num:]
        tables.append(blocks + [0] * (width - num))
        for pos in range(ctx):
            slot = blocks[pos // PAGE] * PAGE + pos % PAGE
            (slots if pos >= ctx - q_len else cached).append(slot)
    if cached:
        idx = torch.tensor(cached, dtype=torch.int64, device=device)
        rows = torch.randn(2, len(cached), kv_heads, head_dim, generator=gen).to(dtype).to(device)
        key_cache[idx // PAGE, idx % PAGE] = rows[0]
        value_cache[idx // PAGE, idx % PAGE] = rows[1]
    num_tokens = sum(query_lens)
    new = torch.randn(2, num_tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    if write_new:
        pages, offsets = slot_mapping // PAGE, slot_mapping % PAGE
        key_cache[pages, offsets] = new[0]
        value_cache[pages, offsets] = new[1]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(num_tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedCase(
        query=query.to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
        query_lens=list(query_lens),
        context_lens_host=list(context_lens),
        slot_mapping=slot_mapping,
        new_key=new[0],
        new_value=new[1],
    )
