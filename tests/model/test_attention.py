"""TorchAttentionBackend against a dense float64 reference built from contiguous K/V."""

from __future__ import annotations

import random

import pytest
import torch

from asyncpaged.model.attention import AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.kv_cache import PagedKVCache

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 6, 2, 8


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q [n, Hq, D] for the last n of ctx positions; k, v [ctx, Hkv, D] -> [n, Hq, D]."""
    n, ctx, group = q.shape[0], k.shape[0], HEADS // KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(n):
        pos = ctx - n + j
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(HEADS):
            keys, values = (
                k[lo : pos + 1, h // group].double(),
                v[lo : pos + 1, h // group].double(),
            )
            weights = torch.softmax(keys @ q[j, h].double() * HEAD_DIM**-0.5, dim=0)
            out[j, h] = weights @ values
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_prefill_chunks_and_decodes_match_dense_reference(window: int | None) -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    # (tokens already cached, new tokens): decodes at page boundaries, a first chunk, later chunks
    shapes = [(15, 1), (16, 1), (31, 1), (0, 17), (16, 16), (5, 12), (47, 1), (1, 1), (0, 1)]
    num_blocks = 40
    cache = PagedKVCache(
        num_layers=2,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        fill_value=float("nan"),
    )
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, history, queries = [], [], [], []
    for cached, new in shapes:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // BLOCK))]
        all_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
        k = torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen)
        if cached:
            cache.write(1, k[:cached], v[:cached], all_slots[:cached])
        tables.append(table)
        slots.extend(all_slots[cached:].tolist())
        history.append((k, v))
        queries.append(torch.randn(new, HEADS, HEAD_DIM, generator=gen))
    md = AttentionMetadata.build(
        query_lens=[n for _, n in shapes],
        context_lens=[c + n for c, n in shapes],
        block_tables=tables,
        slot_mapping=slots,
        device=torch.device("cpu"),
    )
    new_k = torch.cat([k[c:] for (k, _), (c, _) in zip(history, shapes, strict=True)])
    new_v = torch.cat([v[c:] for (_, v), (c, _) in zip(history, shapes, strict=True)])
    out = TorchAttentionBackend().forward(
        1, torch.cat(queries), new_k, new_v, cache, md, scale=HEAD_DIM**-0.5, sliding_window=window
    )
    assert not out.isnan().any()
    start = 0
    for (k, v), q in zip(history, queries, strict=True):
        want = _reference(q, k, v, window)
        torch.testing.assert_close(
            out[start : start + q.shape[0]].double(), want, atol=1e-5, rtol=1e-5
        )
        start += q.shape[0]
    assert bool(cache.key[0].isnan().all()), "layer 0 was written"
