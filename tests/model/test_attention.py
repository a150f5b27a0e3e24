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


def _check_against_reference(
    shapes: list[tuple[int, int]],
    window: int | None,
    backend: TorchAttentionBackend,
    *,
    seed: int = 0,
    num_blocks: int = 40,
) -> None:
    """Write each sequence's cached K/V into scattered blocks of a NaN-poisoned cache, run one
    step of (cached, new) shapes through ``backend`` and compare with the dense reference."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
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
    out = backend.forward(
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


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_prefill_chunks_and_decodes_match_dense_reference(window: int | None) -> None:
    # (tokens already cached, new tokens): decodes at page boundaries, a first chunk, later chunks
    shapes = [(15, 1), (16, 1), (31, 1), (0, 17), (16, 16), (5, 12), (47, 1), (1, 1), (0, 1)]
    _check_against_reference(shapes, window, TorchAttentionBackend())


@pytest.mark.parametrize("group_size", [1, 3, 8, 64])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_groups_match_dense_reference(group_size: int, window: int | None) -> None:
    # Many decodes of mixed lengths: several groups, groups of one block, full and partial
    # last blocks, and a prefill in the same step.
    rng = random.Random(group_size)
    shapes = [(rng.choice([0, 1, 14, 15, 16, 17, 31, 40, 63, 80]), 1) for _ in range(20)]
    shapes.insert(7, (10, 9))
    _check_against_reference(shapes, window, TorchAttentionBackend(group_size), num_blocks=200)


def test_decode_plan_is_rebuilt_for_each_step() -> None:
    # One backend across steps whose metadata differs: a stale per-step plan would mis-attend.
    backend = TorchAttentionBackend(decode_group_size=4)
    for seed, shapes in enumerate([[(5, 1), (40, 1)], [(33, 1), (2, 1), (17, 1)], [(5, 1)] * 6]):
        _check_against_reference(shapes, None, backend, seed=seed)


def test_invalid_decode_group_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="decode_group_size must be > 0"):
        TorchAttentionBackend(decode_group_size=0)
