"""The paged KV cache moves exactly the named blocks; everything else stays untouched (NaN).

Both layouts: "runner" (K transposed per block, the CPU kernels') and "nhd" (the Triton
backend's)."""

from __future__ import annotations

import pytest
import torch

from asyncpaged.model.kv_cache import KVLayout, PagedKVCache, swap_in, swap_out

NUM_LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 3, 2, 8, 16
LAYOUTS: list[KVLayout] = ["runner", "nhd"]


def _cache(num_blocks: int, layout: KVLayout = "runner") -> PagedKVCache:
    return PagedKVCache(
        num_layers=NUM_LAYERS,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        fill_value=float("nan"),
        layout=layout,
    )


def _slot_rows(
    cache: PagedKVCache, layer: int, block: int, offset: int
) -> tuple[torch.Tensor, ...]:
    """The [kv_heads, head_dim] K and V rows of one slot, indexed by hand per layout."""
    if cache.layout == "nhd":
        return cache.key[layer, block, offset], cache.value[layer, block, offset]
    return cache.key[layer, block, :, :, offset], cache.value[layer, block, :, offset, :]


def _fill_blocks(cache: PagedKVCache, blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for b in blocks:
        cache.key[:, b] = torch.randn(cache.key[:, b].shape, generator=gen)
        cache.value[:, b] = torch.randn(cache.value[:, b].shape, generator=gen)


def _nan_blocks(cache: PagedKVCache) -> set[int]:
    k = cache.key.isnan().flatten(2).all(-1).all(0)  # [num_blocks]
    v = cache.value.isnan().flatten(2).all(-1).all(0)
    return {i for i in range(cache.num_blocks) if bool(k[i]) and bool(v[i])}


def test_layout_is_k_transposed_per_block() -> None:
    cache = _cache(4)
    assert cache.key.shape == (NUM_LAYERS, 4, KV_HEADS, HEAD_DIM, BLOCK)
    assert cache.value.shape == (NUM_LAYERS, 4, KV_HEADS, BLOCK, HEAD_DIM)


def test_nhd_layout_is_position_major_for_k_and_v() -> None:
    cache = _cache(4, "nhd")
    assert cache.key.shape == cache.value.shape == (NUM_LAYERS, 4, BLOCK, KV_HEADS, HEAD_DIM)
    assert cache.key.is_contiguous() and cache.value.is_contiguous()
    with pytest.raises(ValueError, match="layout"):
        _cache(4, "hnd")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_stores_rows_at_slots_and_skips_minus_one(layout: KVLayout) -> None:
    cache = _cache(6, layout)
    slots = torch.tensor([5 * BLOCK + 3, -1, 2 * BLOCK + 15, 0])
    key = torch.randn(4, KV_HEADS, HEAD_DIM)
    value = torch.randn(4, KV_HEADS, HEAD_DIM)
    cache.write(1, key, value, slots)
    for row, (block, offset) in ((0, (5, 3)), (2, (2, 15)), (3, (0, 0))):
        k, v = _slot_rows(cache, 1, block, offset)
        assert torch.equal(k, key[row])
        assert torch.equal(v, value[row])
    written = cache.key[1].isnan().logical_not().sum().item()
    assert written == 3 * KV_HEADS * HEAD_DIM, "a skipped (-1) row or another slot was written"
    assert bool(cache.key[0].isnan().all())
    assert bool(cache.key[2].isnan().all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_blocks_copies_exactly_the_pairs_in_every_layer(layout: KVLayout) -> None:
    cache = _cache(10, layout)
    _fill_blocks(cache, [1, 4, 7], seed=0)
    before = cache.key.clone(), cache.value.clone()
    cache.copy_blocks([(4, 2), (1, 9), (7, 5)])
    for src, dst in ((4, 2), (1, 9), (7, 5)):
        assert torch.equal(cache.key[:, dst], before[0][:, src])
        assert torch.equal(cache.value[:, dst], before[1][:, src])
    for b in (1, 4, 7):  # sources unchanged
        assert torch.equal(cache.key[:, b], before[0][:, b])
    assert _nan_blocks(cache) == {0, 3, 6, 8}


def test_copy_blocks_rejects_duplicate_destinations() -> None:
    cache = _cache(4)
    with pytest.raises(AssertionError, match="duplicate destination"):
        cache.copy_blocks([(0, 2), (1, 2)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swap_out_and_in_move_exactly_the_named_blocks(layout: KVLayout) -> None:
    device, host = _cache(12, layout), _cache(6, layout)
    _fill_blocks(device, [3, 8, 11, 0], seed=1)
    original = device.key.clone(), device.value.clone()
    swap_out(device, host, [(8, 4), (3, 0), (11, 5)])
    for d, h in ((8, 4), (3, 0), (11, 5)):
        assert torch.equal(host.key[:, h], original[0][:, d])
        assert torch.equal(host.value[:, h], original[1][:, d])
    assert _nan_blocks(host) == {1, 2, 3}
    assert torch.equal(device.key.nan_to_num(7.0), original[0].nan_to_num(7.0))  # source intact

    target = _cache(12, layout)
    swap_in(target, host, [(4, 1), (0, 6), (5, 10)])
    for d, h in ((1, 4), (6, 0), (10, 5)):
        assert torch.equal(target.key[:, d], host.key[:, h])
        assert torch.equal(target.value[:, d], host.value[:, h])
    assert _nan_blocks(target) == set(range(12)) - {1, 6, 10}


def test_swap_rejects_a_cache_of_another_layout() -> None:
    other = PagedKVCache(
        num_layers=NUM_LAYERS,
        num_blocks=4,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS + 1,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
    )
    with pytest.raises(AssertionError, match="layout"):
        swap_out(_cache(4), other, [(0, 0)])
    # same shapes (block size = kv heads = head dim), other layout: refused too
    square = {"num_layers": 1, "num_blocks": 2, "block_size": 4, "num_kv_heads": 4,
              "head_dim": 4, "dtype": torch.float32}  # fmt: skip
    runner, nhd = PagedKVCache(**square), PagedKVCache(**square, layout="nhd")  # type: ignore[arg-type]
    assert runner.key.shape == nhd.key.shape
    with pytest.raises(AssertionError, match="layout"):
        swap_in(runner, nhd, [(0, 1)])
