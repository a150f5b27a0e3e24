"""Scenario tests with exact block ids, slots and eviction order (block size 4 for readability).

Placement rule under test (see PhysicalBlocks.take): the block right after the sequence's last
block if it is free or fresh, else the oldest free block, else the next fresh block, else the
least recently used cached block.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from asyncpaged.errors import BlockPoolError
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import Location, SwapDirection

BS = 4


def make_pool(num_device: int = 8, num_host: int = 4, caching: bool = True) -> BlockPool:
    return BlockPool(num_device, num_host, block_size=BS, enable_prefix_caching=caching)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_allocate_maps_tokens_to_exact_blocks_and_slots() -> None:
    pool = make_pool()
    a = pool.allocate("a", toks(100, 10))
    assert a is not None
    assert a.block_ids == (0, 1, 2)
    assert a.num_cached_tokens == 0
    assert a.slot_mapping == tuple(range(10))
    b = pool.allocate("b", toks(200, 5))
    assert b is not None
    assert b.block_ids == (3, 4)
    assert b.slot_mapping == (12, 13, 14, 15, 16)
    assert pool.num_free_device_blocks == 3


def test_append_takes_a_block_only_when_the_last_is_full() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 3))
    r = pool.append("a", [1])
    assert r is not None
    assert (r.slot_mapping, r.copy_on_write, pool.block_ids("a")) == ((3,), (), (0,))
    r = pool.append("a", [2])
    assert r is not None
    assert (r.slot_mapping, pool.block_ids("a")) == ((4,), (0, 1))
    r = pool.append("a", [3, 4, 5, 6, 7])  # a chunk spanning two blocks
    assert r is not None
    assert (r.slot_mapping, pool.block_ids("a")) == ((5, 6, 7, 8, 9), (0, 1, 2))


def test_chunked_allocate_reserves_only_the_chunk() -> None:
    pool = make_pool()
    a = pool.allocate("a", toks(100, 10), max_new_tokens=3)
    assert a is not None
    assert (a.block_ids, a.slot_mapping, pool.num_tokens("a")) == ((0,), (0, 1, 2), 3)
    r = pool.append("a", toks(103, 7))
    assert r is not None
    assert r.slot_mapping == (3, 4, 5, 6, 7, 8, 9)


def test_fork_shares_blocks_and_copy_on_write_copies_the_partial_block_once() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 6))  # blocks 0 (full), 1 (2 of 4 slots)
    pool.fork("a", "b")
    assert pool.block_ids("b") == (0, 1)
    assert pool.device.ref_cnt[:2] == [2, 2]
    assert pool.num_free_device_blocks == 6  # fork took nothing
    r = pool.append("b", [9])
    assert r is not None
    assert r.copy_on_write == ((1, 2),)  # b writes into its own copy
    assert r.slot_mapping == (2 * BS + 2,)
    assert pool.block_ids("b") == (0, 2)
    r = pool.append("a", [8])  # a is the sole holder of block 1 now: no copy
    assert r is not None
    assert (r.copy_on_write, r.slot_mapping) == ((), (1 * BS + 2,))
    assert pool.device.ref_cnt[:3] == [2, 1, 1]
    assert pool.statistics().num_cow_copies == 1


def test_full_shared_blocks_are_not_copied() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 8))
    pool.fork("a", "b")
    r = pool.append("b", [1])
    assert r is not None
    assert (r.copy_on_write, pool.block_ids("b")) == ((), (0, 1, 2))


def test_free_releases_tail_first_into_the_lru() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 13))  # blocks 0,1,2 full (cached), 3 partial
    pool.free("a")
    assert pool.device.evictable_blocks() == [2, 1, 0]  # tail enters the LRU first
    assert pool.device.free_blocks()[:1] == [3]
    stats = pool.statistics()
    assert (stats.device.free, stats.device.cached, stats.device.used) == (5, 3, 0)


def test_eviction_is_lru_and_breaks_the_chain_where_it_evicts() -> None:
    pool = make_pool(num_device=4)
    x = toks(100, 9)
    pool.allocate("x", x)  # 0,1 full and cached; 2 partial
    pool.free("x")  # evictable [1, 0]; free [2]; fresh [3]
    y = pool.allocate("y", toks(500, 12))
    assert y is not None
    # first block: oldest free (2); next: right after it, fresh (3); then evict the LRU (1)
    assert y.block_ids == (2, 3, 1)
    assert pool.device.evictable_blocks() == [0]
    hit = pool.lookup_prefix(x)
    assert (hit.block_ids, hit.num_tokens) == ((0,), 4)


def test_prefix_hit_maps_cached_blocks_but_never_the_last_token() -> None:
    pool = make_pool()
    prompt = toks(100, 8)
    pool.allocate("a", prompt)  # blocks 0, 1: both full and cached
    b = pool.allocate("b", prompt)  # same prompt: the last token must be recomputed
    assert b is not None
    assert (b.block_ids, b.num_cached_tokens, b.slot_mapping) == ((0, 2), 4, (8, 9, 10, 11))
    c = pool.allocate("c", [*prompt, 7])
    assert c is not None
    assert (c.block_ids, c.num_cached_tokens, c.slot_mapping) == ((0, 1, 3), 8, (12,))
    assert pool.device.ref_cnt[:4] == [3, 2, 1, 1]
    stats = pool.statistics()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (8 + 8 + 9, 4 + 8)


def test_a_hit_takes_a_cached_block_out_of_the_lru() -> None:
    pool = make_pool(num_device=4)
    pool.allocate("a", toks(100, 9))  # 0, 1 cached; 2 partial
    pool.free("a")
    assert pool.num_free_device_blocks == 4
    assert pool.num_blocks_to_allocate(toks(100, 9)) == 3  # 2 hits from the LRU + 1 new
    assert pool.num_blocks_to_allocate(toks(100, 8)) == 2  # 1 hit + 1 new
    b = pool.allocate("b", toks(100, 9))
    assert b is not None
    assert b.block_ids == (0, 1, 2)
    assert pool.device.evictable_blocks() == []


def test_extra_key_isolates_tenants() -> None:
    pool = make_pool()
    prompt = toks(100, 9)
    pool.allocate("a", prompt, extra_key="tenant-1")
    assert pool.lookup_prefix(prompt, "tenant-1").num_tokens == 8
    assert pool.lookup_prefix(prompt, "tenant-2").num_tokens == 0
    assert pool.lookup_prefix(prompt).num_tokens == 0


def test_prefix_caching_off_registers_nothing() -> None:
    pool = make_pool(caching=False)
    pool.allocate("a", toks(100, 9))
    b = pool.allocate("b", toks(100, 9))
    assert b is not None
    assert b.num_cached_tokens == 0
    pool.free("a")
    assert pool.statistics().device.cached == 0
    with pytest.raises(BlockPoolError, match="enable_prefix_caching"):
        pool.pin_prefix(toks(100, 8))


def test_failed_allocation_returns_none_and_changes_nothing() -> None:
    pool = make_pool(num_device=3)
    pool.allocate("a", toks(100, 9))
    before = pool.state()
    assert not pool.can_allocate(toks(200, 5))
    assert pool.allocate("b", toks(200, 5)) is None
    pool.fork("a", "a2")
    before = pool.state()
    assert pool.append("a2", [1, 2, 3, 4]) is None  # needs a CoW copy and a new block: 2 > 0
    assert not pool.can_append("a2", 4)
    assert pool.state() == before


def test_pinned_prefix_is_never_evicted_until_unpinned() -> None:
    pool = make_pool(num_device=4)
    prefix = toks(100, 8)
    assert pool.pin_prefix(prefix) is None  # not computed yet: nothing to pin
    pool.allocate("a", [*prefix, 1])
    pin = pool.pin_prefix(prefix)
    assert pin is not None
    assert (pin.block_ids, pin.num_tokens) == ((0, 1), 8)
    pool.free("a")
    assert pool.evict_cached_blocks() == 0  # pinned blocks are held, not evictable
    assert pool.allocate("big", toks(500, 9)) is None  # only blocks 2, 3 can be taken
    b = pool.allocate("b", [*prefix, 2, 3])
    assert b is not None
    assert b.block_ids == (0, 1, 2)
    pool.free("b")
    pool.unpin_prefix(pin.pin_id)
    assert pool.device.evictable_blocks() == [1, 0]
    with pytest.raises(BlockPoolError, match="at least one full block"):
        pool.pin_prefix([1, 2])


def test_swap_out_keeps_sharing_and_holds_blocks_in_flight() -> None:
    pool = make_pool(num_device=4, num_host=4)
    pool.allocate("a", toks(100, 6))  # 0 full, 1 partial
    pool.fork("a", "b")
    pool.append("b", [5])  # b: [0, 2] (CoW of 1)
    plan = pool.swap_out(["a", "b"])
    assert plan is not None
    assert plan.direction is SwapDirection.OUT
    assert plan.block_mapping == ((0, 0), (1, 1), (2, 2))  # block 0 shared: copied once
    assert (pool.block_ids("a"), pool.block_ids("b")) == ((0, 1), (0, 2))  # host ids now
    assert pool.location("a") is Location.SWAPPING_OUT
    assert pool.host.ref_cnt[:3] == [3, 2, 2]  # tables + the copy in flight
    stats = pool.statistics()
    assert (stats.device.in_flight, stats.host.in_flight, stats.device.used) == (3, 3, 0)
    # The device blocks being copied out cannot be handed out yet.
    assert pool.num_free_device_blocks == 1
    assert pool.allocate("c", toks(900, 5)) is None
    with pytest.raises(BlockPoolError, match="not on device"):
        pool.append("a", [1])
    pool.complete_swap(plan.swap_id)
    assert pool.location("a") is Location.HOST
    assert pool.device.evictable_blocks() == [0]  # full block 0 stays cached on the device
    assert pool.num_free_device_blocks == 4
    assert pool.statistics().host.used == 3


def test_swap_in_restores_sharing_and_reregisters_full_blocks() -> None:
    pool = make_pool(num_device=4, num_host=4)
    pool.allocate("a", toks(100, 6))
    pool.fork("a", "b")
    out = pool.swap_out(["a", "b"])
    assert out is not None
    pool.complete_swap(out.swap_id)
    pool.evict_cached_blocks()
    assert pool.lookup_prefix(toks(100, 6)).num_tokens == 0
    assert pool.device.free_blocks() == [1, 0, 2, 3]  # partial 1 freed first, then evicted 0
    plan = pool.swap_in(["b", "a"])
    assert plan is not None
    assert plan.block_mapping == ((0, 1), (1, 2))  # oldest free, then the block right after
    assert pool.location("a") is Location.SWAPPING_IN
    assert pool.lookup_prefix(toks(100, 6)).num_tokens == 0  # not readable until copied
    pool.complete_swap(plan.swap_id)
    assert pool.block_ids("a") == pool.block_ids("b") == (1, 2)
    assert pool.device.ref_cnt[:3] == [0, 2, 2]
    assert pool.lookup_prefix(toks(100, 6)).block_ids == (1,)
    r = pool.append("a", [1])  # the shared partial block is copied on write again
    assert r is not None
    assert r.copy_on_write == ((2, 0),)


def test_swap_is_all_or_nothing() -> None:
    pool = make_pool(num_device=8, num_host=2)
    pool.allocate("a", toks(100, 9))  # 3 blocks
    before = pool.state()
    assert not pool.can_swap_out(["a"])
    assert pool.swap_out(["a"]) is None
    assert pool.state() == before


def test_free_during_swap_keeps_in_flight_blocks_until_complete() -> None:
    pool = make_pool(num_device=4, num_host=4)
    pool.allocate("a", toks(100, 5))
    plan = pool.swap_out(["a"])
    assert plan is not None
    pool.free("a")  # aborted mid-swap
    assert pool.statistics().host.in_flight == 2
    assert pool.num_free_host_blocks == 2  # host blocks still being written
    pool.complete_swap(plan.swap_id)
    assert pool.num_free_host_blocks == 4
    assert pool.num_free_device_blocks == 4
    pool.check_invariants()


def test_bad_calls_raise_and_leave_the_pool_unchanged() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 5))
    pool.allocate("s", toks(200, 5))
    plan = pool.swap_out(["s"])
    assert plan is not None
    pool.complete_swap(plan.swap_id)
    before = pool.state()
    with pytest.raises(BlockPoolError, match="unknown sequence 'nope'"):
        pool.free("nope")
    with pytest.raises(BlockPoolError, match="cannot fork into 's'"):
        pool.fork("a", "s")
    with pytest.raises(BlockPoolError, match="cannot append to sequence 's': it is host"):
        pool.append("s", [1])
    with pytest.raises(BlockPoolError, match="already exists"):
        pool.allocate("a", [1])
    with pytest.raises(BlockPoolError, match="cannot swap in sequence 'a'"):
        pool.swap_in(["a"])
    with pytest.raises(BlockPoolError, match="max_new_tokens"):
        pool.allocate("z", [1, 2], max_new_tokens=0)
    assert pool.state() == before


def test_statistics_partition_and_utilization() -> None:
    pool = make_pool(num_device=8)
    pool.allocate("a", toks(100, 6))  # 0 full, 1 half
    pool.fork("a", "b")
    pool.allocate("c", toks(300, 4))  # 2 full
    stats = pool.statistics()
    assert stats.device == type(stats.device)(total=8, free=5, used=3, cached=0, in_flight=0)
    assert stats.num_filled_device_slots == 4 + 2 + 4  # shared blocks count once
    assert stats.device_utilization == pytest.approx(10 / 12)
    assert (stats.num_seqs, stats.num_pins, stats.num_swaps_in_flight) == (3, 0, 0)


def test_placement_keeps_a_sequence_in_one_physical_run() -> None:
    pool = make_pool(num_device=64)
    for i in range(8):
        pool.allocate(i, toks(1000 * i, 4))
    for i in range(8):
        pool.append(i, toks(1000 * i + 4, 1))  # interleaved growth
    for i in range(8):
        pool.free(i)
    pool.allocate("long", toks(50_000, 4 * 20))
    ids = pool.block_ids("long")
    runs = 1 + sum(1 for x, y in itertools.pairwise(ids) if y != x + 1)
    assert runs <= 3, ids


def test_blocks_freed_by_a_swap_exclude_blocks_shared_outside_the_group() -> None:
    pool = make_pool(num_device=8, num_host=8)
    pool.allocate("a", toks(100, 9))  # 0, 1 full (cached), 2 partial
    pool.allocate("b", [*toks(100, 8), 5])  # hits 0, 1; own block 3
    plan = pool.swap_out(["a"])
    assert plan is not None
    assert pool.num_blocks_freed_by_swap(plan.swap_id) == 1  # only block 2: b still holds 0, 1
    pool.complete_swap(plan.swap_id)
    with pytest.raises(BlockPoolError, match="no swap in flight"):
        pool.num_blocks_freed_by_swap(plan.swap_id)


# ---- speculative slots and truncate --------------------------------------------------------


def test_truncate_drops_rejected_blocks_and_caches_only_verified_ones() -> None:
    pool = make_pool()
    prompt = toks(100, 6)
    pool.allocate("a", prompt)  # blocks 0 (full, cached), 1 (2 of 4)
    # the last sampled token 7 and four proposals 20..23: positions 6..10
    r = pool.append("a", [7, 20, 21, 22, 23], num_speculative_tokens=4)
    assert r is not None
    assert (r.slot_mapping, pool.block_ids("a")) == ((6, 7, 8, 9, 10), (0, 1, 2))
    assert pool.has_speculative_tokens("a")
    assert pool.device.hash_of(1) is None  # full, but holds proposal 20: not cached yet
    assert pool.lookup_prefix([*prompt, 7, 20, 99]).num_tokens == 4
    # one proposal accepted: keep 8 tokens; block 2 held only proposals
    assert pool.truncate("a", 8) == (2,)
    assert not pool.has_speculative_tokens("a")
    assert (pool.block_ids("a"), pool.num_tokens("a")) == ((0, 1), 8)
    assert pool.device.free_blocks()[0] == 2  # released, first in line again
    assert pool.lookup_prefix([*prompt, 7, 20, 99]).block_ids == (0, 1)  # verified: cached now
    r = pool.append("a", [5])
    assert r is not None
    assert (r.slot_mapping, pool.block_ids("a")) == ((8,), (0, 1, 2))
    pool.check_invariants()


def test_a_rejected_token_never_enters_the_prefix_cache() -> None:
    pool = make_pool()
    prompt = toks(100, 6)
    pool.allocate("a", prompt)
    pool.append("a", [7, 20, 21], num_speculative_tokens=2)  # block 1 fills with 20; 21 in 2
    assert pool.truncate("a", 7) == (2,)  # 20 and 21 rejected
    assert pool.block_ids("a") == (0, 1)
    assert pool.device.num_filled[1] == 3  # the rejected slot is forgotten
    assert pool.lookup_prefix([*prompt, 7, 20, 99]).num_tokens == 4
    r = pool.append("a", [8])  # the target's own token overwrites slot 7 in place
    assert r is not None
    assert (r.slot_mapping, r.copy_on_write) == ((7,), ())
    assert pool.lookup_prefix([*prompt, 7, 20, 99]).num_tokens == 4
    assert pool.lookup_prefix([*prompt, 7, 8, 99]).block_ids == (0, 1)
    pool.check_invariants()


def test_truncate_into_a_block_a_fork_shares_copies_on_the_next_append() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 7))  # blocks 0, 1 (3 of 4)
    pool.fork("a", "b")
    assert pool.truncate("b", 5) == ()  # block 1 is a's too: nothing released, nothing changed
    assert pool.device.ref_cnt[:2] == [2, 2]
    assert pool.device.num_filled[1] == 3  # a's slots stay counted
    assert pool.shared_tails() == {"a", "b"}
    r = pool.append("b", [9])
    assert r is not None
    assert r.copy_on_write == ((1, 2),)
    assert (r.slot_mapping, pool.block_ids("b")) == ((2 * BS + 1,), (0, 2))
    assert pool.device.num_filled[2] == 2  # b's one kept slot of the copy, then the new one
    r = pool.append("a", [8])  # a alone holds block 1 now
    assert r is not None
    assert (r.slot_mapping, r.copy_on_write) == ((1 * BS + 3,), ())
    pool.check_invariants()


def test_truncate_to_the_whole_length_verifies_every_proposal() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 3))
    pool.append("a", [7, 20, 21, 22, 23, 24], num_speculative_tokens=5)  # 9 tokens: 0, 1, 2
    assert pool.device.hash_of(0) is not None  # 100 101 102 7: verified, cached at once
    assert pool.device.hash_of(1) is None  # 20 21 22 23: proposals
    assert pool.truncate("a", 9) == ()
    assert pool.device.hash_of(1) is not None
    assert pool.lookup_prefix([*toks(100, 3), 7, 20, 21, 22, 23, 24]).block_ids == (0, 1)
    pool.check_invariants()


def test_an_unverified_sequence_cannot_grow_fork_or_swap_out() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 5))
    pool.append("a", [7, 20], num_speculative_tokens=1)
    before = pool.state()
    assert pool.append_token("a", 8) is None
    with pytest.raises(BlockPoolError, match="not yet verified"):
        pool.append("a", [8])
    with pytest.raises(BlockPoolError, match="not yet verified"):
        pool.fork("a", "b")
    with pytest.raises(BlockPoolError, match="not yet verified"):
        pool.swap_out(["a"])
    with pytest.raises(BlockPoolError, match="keep at least 1"):
        pool.truncate("a", 8)
    with pytest.raises(BlockPoolError, match="num_speculative_tokens"):
        pool.append("a", [8], num_speculative_tokens=2)
    assert pool.state() == before
    pool.free("a")
    assert not pool.has_seq("a")
    pool.check_invariants()


def test_truncate_needs_the_tokens_of_its_new_last_block() -> None:
    pool = make_pool()
    pool.allocate("a", toks(100, 10))  # blocks 0, 1 full and cached; block 2 holds 2
    before = pool.state()
    with pytest.raises(BlockPoolError, match="no longer known"):
        pool.truncate("a", 6)  # into cached block 1: its tokens are only a hash now
    assert pool.state() == before
    assert pool.truncate("a", 9) == ()  # inside the partial last block
    assert pool.truncate("a", 4) == (1, 2)  # to a block boundary (released tail first)
    assert pool.device.evictable_blocks() == [1]  # verified and full: stays cached
    assert pool.device.free_blocks()[0] == 2
    pool.check_invariants()
    off = make_pool(caching=False)
    off.allocate("a", toks(100, 10))
    assert off.truncate("a", 6) == (2,)  # without a cache every length is fine
    assert off.device.num_filled[1] == 2
    off.check_invariants()


def test_admission_hashes_each_prompt_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size check, the allocation and the blocks the allocation fills share one hash
    chain (admission hashes each prompt once, not twice); the result is the same chain."""
    from asyncpaged.kv import prefix_cache
    from asyncpaged.kv.prefix_hash import hash_full_blocks

    calls = 0
    real = prefix_cache.hash_block

    def counting(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(prefix_cache, "hash_block", counting)
    pool = BlockPool(num_device_blocks=64, block_size=4)
    first = tuple(range(100, 141))  # 10 full blocks and one token
    for _ in range(3):  # the same tuple checked again
        assert pool.num_blocks_to_allocate(first) == 11
    assert calls == 1  # a size check hashes up to the first block the cache lacks, once
    assert pool.allocate(1, first) is not None
    assert calls == 10
    assert pool._tables[1].block_hashes == hash_full_blocks(first, 4, None, 10)
    # A second prompt sharing 6 blocks: its own 10 blocks hashed once, 6 of them cache hits.
    second = (*first[:24], *range(500, 517))
    assert pool.num_blocks_to_allocate(second) == 5
    alloc = pool.allocate(2, second)
    assert alloc is not None and alloc.num_cached_tokens == 24
    assert calls == 20
    assert pool._tables[2].block_hashes == hash_full_blocks(second, 4, None, 10)
    # A list (it could change between calls) is hashed as before, block by block.
    pool.allocate(3, list(range(900, 909)))
    assert calls == 20 + 1 + 2  # the lookup that misses, then each block as it fills
    pool.check_invariants()


def test_prompt_hashes_keep_a_bounded_number_of_prompt_tokens() -> None:
    from asyncpaged.kv.prefix_cache import PromptHashes
    from asyncpaged.kv.prefix_hash import hash_full_blocks

    memo = PromptHashes(block_size=4, max_tokens=100)
    prompts = [tuple(range(i * 1000, i * 1000 + 30)) for i in range(10)]
    for p in prompts:
        assert list(memo.of(p, None) or ()) == hash_full_blocks(p, 4, None, 7)
        assert memo.num_tokens <= 100
    assert memo.of(prompts[-1], None) is memo.of(prompts[-1], None)  # kept, not recomputed
    assert list(memo.of(prompts[-1], "salt") or ()) == hash_full_blocks(prompts[-1], 4, "salt", 7)
    assert memo.num_tokens <= 100
    huge = tuple(range(500))  # longer than the bound: kept alone
    assert list(memo.of(huge, None) or ()) == hash_full_blocks(huge, 4, None, 125)
    assert memo.num_tokens == 500
    assert memo.of([1, 2, 3, 4], None) is None  # a list may change: never memoized


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_append_token_after_a_late_token_changes_nothing_when_it_refuses(
    enable_prefix_caching: bool,
) -> None:
    """append_token onto a placeholder raises (with prefix caching the token must be settled
    first) before touching the sequence: its length, its block's fill and the pool's invariants
    are as before."""
    from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN

    pool = BlockPool(4, block_size=4, enable_prefix_caching=enable_prefix_caching)
    assert pool.allocate("s", [3], max_new_tokens=None, extra_key=None) is not None
    assert pool.append_token("s", PLACEHOLDER_TOKEN) is not None
    before = pool.statistics(), pool.device.state()
    if enable_prefix_caching:
        with pytest.raises(BlockPoolError, match="late"):
            pool.append_token("s", 3)
        assert (pool.statistics(), pool.device.state()) == before
        pool.check_invariants()
        pool.set_placeholder("s", 7)
    assert pool.append_token("s", 3) is not None
    pool.check_invariants()
    pool.free("s")
