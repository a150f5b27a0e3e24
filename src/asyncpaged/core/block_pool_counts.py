"""Counting queries of the block pool: what an allocation would reuse and take (its
:class:`AllocationPlan`), the device blocks that appends take (copy-on-write included), what
freeing a group would release, which tables share their partial last block, and a pool's usage.

Pure reads of the device pool, tier index and tables they are given: nothing here changes
state (but for the prompt-hash memo, a cache of a pure function); the
:class:`~asyncpaged.core.block_pool.BlockPool` checks its arguments first.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from asyncpaged.core.block_pool_checks import device_table
from asyncpaged.core.block_pool_prefix import HashChain, PromptHashes, match_prefix, match_tiers
from asyncpaged.core.block_table import BlockTable, Location, PoolUsage, SeqId
from asyncpaged.core.kv_tiers import TierIndex
from asyncpaged.core.physical_blocks import PhysicalBlocks
from asyncpaged.core.prefix_hash import BlockHash
from asyncpaged.errors import BlockPoolError


@dataclass(frozen=True, slots=True)
class AllocationPlan:
    """What :meth:`BlockPool.allocate` does for a prompt: the cached device blocks it maps in
    (``hit``, with their ``hashes``), the tier hits it restores after them, the tokens it
    reserves slots up to (``num_tokens``), and the allocatable device blocks it takes; and the
    hash ``chain`` of the prompt's full blocks (None: not known, or prefix caching off)."""

    hit: list[int]
    hashes: list[BlockHash]
    restored: list[BlockHash]
    num_cached_tokens: int
    num_tokens: int
    num_blocks: int
    chain: HashChain | None


def plan_allocation(
    device: PhysicalBlocks,
    tiers: TierIndex | None,
    prompt_hashes: PromptHashes,
    token_ids: Sequence[int],
    max_new_tokens: int | None,
    extra_key: str | None,
    read_cache: bool,
    caching: bool,
) -> AllocationPlan:
    """The :class:`AllocationPlan` of a prompt against the cache and tiers as they are now
    (``read_cache=False``: no hit); raises for ``max_new_tokens < 1``. With ``caching`` the
    prompt's block hashes come from ``prompt_hashes``, the memo that hashes each prompt once."""
    bs = device.block_size
    chain = prompt_hashes.of(token_ids, extra_key) if caching else None
    hit, hashes = match_prefix(
        device, token_ids, extra_key, None if read_cache else 0, caching=caching, chain=chain
    )
    restored = match_tiers(device, tiers, token_ids, extra_key, hashes, chain) if read_cache else []
    num_hit = len(hit) + len(restored)
    num_tokens = num_tokens_after_allocate(bs, token_ids, num_hit, max_new_tokens)
    num_new_blocks = -(-num_tokens // bs) - len(hit)
    need = num_new_blocks + sum(1 for b in hit if device.ref_cnt[b] == 0)
    return AllocationPlan(
        hit=hit,
        hashes=hashes,
        restored=restored,
        num_cached_tokens=num_hit * bs,
        num_tokens=num_tokens,
        num_blocks=need,
        chain=chain,
    )


def num_tokens_after_allocate(
    block_size: int, token_ids: Sequence[int], num_hit_blocks: int, max_new_tokens: int | None
) -> int:
    """The table's length after an allocation: the cached blocks, then at most
    ``max_new_tokens`` more prompt tokens (None: the whole rest)."""
    if max_new_tokens is not None and max_new_tokens < 1:
        raise BlockPoolError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    num_cached = num_hit_blocks * block_size
    if max_new_tokens is None:
        return len(token_ids)
    return min(len(token_ids), num_cached + max_new_tokens)


def num_blocks_to_append(device: PhysicalBlocks, table: BlockTable, num_tokens: int) -> int:
    """Device blocks that appending ``num_tokens`` tokens to the device ``table`` takes, a copy
    of its shared partial last block included."""
    bs = device.block_size
    need = -(-(table.num_tokens + num_tokens) // bs) - len(table.block_ids)
    if table.num_tokens % bs and device.ref_cnt[table.block_ids[-1]] > 1:
        need += 1
    return need


def num_blocks_to_append_all(
    tables: Mapping[SeqId, BlockTable], device: PhysicalBlocks, appends: Iterable[tuple[SeqId, int]]
) -> int:
    """Device blocks that these appends (sequence, number of tokens), run in order, take:
    exact for siblings sharing a partial last block (the last of its holders to append writes
    in place, the others copy it). Raises unless every sequence is on the device."""
    bs, ref_cnt = device.block_size, device.ref_cnt
    copied: dict[int, int] = {}  # shared tail block -> holders that copied it away so far
    need = 0
    for seq_id, num_tokens in appends:
        table = device_table(tables, seq_id, "append to")
        need += -(-(table.num_tokens + num_tokens) // bs) - len(table.block_ids)
        if table.num_tokens % bs:
            tail = table.block_ids[-1]
            if ref_cnt[tail] - copied.get(tail, 0) > 1:
                need += 1
                copied[tail] = copied.get(tail, 0) + 1
    return need


def release_counts(
    tables: Mapping[SeqId, BlockTable], ref_cnt: list[int], seq_ids: Sequence[SeqId]
) -> tuple[int, int] | None:
    """(device blocks that freeing the group would release, distinct blocks it holds), or None
    unless every sequence of the group is on the device."""
    if len(seq_ids) == 1:  # the common case: a block of one table is exclusive at refcount 1
        table = tables.get(seq_ids[0])
        if table is None or table.location is not Location.DEVICE:
            return None
        return operator.countOf(map(ref_cnt.__getitem__, table.block_ids), 1), len(table.block_ids)
    holders: dict[int, int] = {}
    for sid in seq_ids:
        table = tables.get(sid)
        if table is None or table.location is not Location.DEVICE:
            return None
        for b in table.block_ids:
            holders[b] = holders.get(b, 0) + 1
    exclusive = sum(1 for b, n in holders.items() if ref_cnt[b] == n)
    return exclusive, len(holders)


def shared_tails(
    forked: Collection[SeqId], tables: Mapping[SeqId, BlockTable], device: PhysicalBlocks
) -> frozenset[SeqId]:
    """The sequences among ``forked`` whose table is on the device with a partial last block
    that other holders share."""
    if not forked:  # the common case: no sequence was ever forked
        return frozenset()
    bs, ref_cnt = device.block_size, device.ref_cnt
    return frozenset(
        sid
        for sid in forked
        if (table := tables[sid]).location is Location.DEVICE
        and table.num_tokens % bs
        and ref_cnt[table.block_ids[-1]] > 1
    )


def check_shared_tails(
    shared: frozenset[SeqId], tables: Mapping[SeqId, BlockTable], device: PhysicalBlocks
) -> None:
    """Assert that ``shared`` (the pool's :func:`shared_tails` of its forked tables) names
    every device table whose partial last block has another holder."""
    bs, ref_cnt = device.block_size, device.ref_cnt
    assert shared == frozenset(
        sid
        for sid, t in tables.items()
        if t.location is Location.DEVICE and t.num_tokens % bs and ref_cnt[t.block_ids[-1]] > 1
    ), "a shared partial last block outside the forked tables"


def pool_usage(pool: PhysicalBlocks) -> PoolUsage:
    """The pool's blocks by state: free, used (held, not in flight), cached, in flight."""
    in_flight = len(pool.in_flight)
    return PoolUsage(
        total=pool.num_blocks,
        free=pool.num_free,
        used=pool.num_held - in_flight,
        cached=pool.num_evictable,
        in_flight=in_flight,
    )
