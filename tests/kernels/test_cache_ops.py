"""reshape_and_cache and copy_blocks vs torch indexing, on NaN-poisoned caches."""

from __future__ import annotations

import pytest
import torch

from asyncpaged.kernels.cache_ops import (
    copy_blocks,
    copy_blocks_reference,
    reshape_and_cache,
    reshape_and_cache_reference,
)
from tests.kernels.cases import PAGE, Layout, make_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("layout", ["runner", "nhd"])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_slots_and_skips_minus_one(
    dtype: torch.dtype, head_dim: int, layout: Layout, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, kv_heads, num_tokens = 4096, 2, 37  # 37: a partial token tile
    _, _, key_cache, value_cache = make_cache(layout, num_blocks, kv_heads, head_dim, dtype, device)
    slots = torch.randperm(num_blocks * PAGE, generator=gen)[:num_tokens]
    slots[[0, 5, 36]] = -1
    slot_mapping = slots.to(device)
    # Rows as slices of a wider qkv-like tensor (strided token dim).
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_reference(key, value, want_k, want_v, slot_mapping)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    _same(key_cache, want_k)
    _same(value_cache, want_v)


def test_reshape_and_cache_rejects_wrong_slot_dtype(device: torch.device) -> None:
    _, _, key_cache, value_cache = make_cache("runner", 8, 2, 64, torch.float32, device)
    rows = torch.randn(3, 2, 64, device=device)
    with pytest.raises(AssertionError, match="slot_mapping must be int64"):
        reshape_and_cache(rows, rows, key_cache, value_cache, torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("layout", ["runner", "nhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_copies_every_layer_in_one_launch(
    dtype: torch.dtype, layout: Layout, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(4)
    num_layers, num_blocks = 3, 64
    key, value, _, _ = make_cache(layout, num_blocks, 2, 80, dtype, device, num_layers=num_layers)
    key.copy_(torch.randn(key.shape, generator=gen).to(dtype))
    value.copy_(torch.randn(value.shape, generator=gen).to(dtype))
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    pairs = [(blocks[i], blocks[i + 10]) for i in range(7)]
    want_k, want_v = key.clone(), value.clone()
    copy_blocks_reference(want_k, want_v, pairs)
    copy_blocks(key, value, pairs)
    _same(key, want_k)
    _same(value, want_v)
    _same(key[:, pairs[0][1]], key[:, pairs[0][0]])


def test_copy_blocks_rejects_overlapping_sources_and_destinations(device: torch.device) -> None:
    key, value, _, _ = make_cache("runner", 8, 2, 64, torch.float32, device, num_layers=2)
    with pytest.raises(AssertionError, match="both a source and a destination"):
        copy_blocks(key, value, [(1, 2), (2, 3)])
    with pytest.raises(AssertionError, match="duplicate destination"):
        copy_blocks(key, value, [(1, 2), (3, 2)])
    copy_blocks(key, value, [])  # nothing to do
