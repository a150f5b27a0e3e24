"""Writing a device block table: reserving slots for new tokens at its end (a block is taken
whenever the last one is full; each block that fills is hashed and, unless it holds a
speculative token, registered in the prefix cache), copy-on-write of a shared partial last
block, and a new sequence's table as its allocation plan says. (The one-token decode fast
path, :meth:`BlockPool.append_token`, stays inline in the pool: it runs per token.)

Functions of the device pool and the table they are given; the
:class:`~asyncpaged.core.block_pool.BlockPool` checks the capacity and the table's state first,
so nothing here fails for want of blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncpaged.core.block_pool_counts import AllocationPlan
from asyncpaged.core.block_pool_prefix import HashChain, restore_from_tiers, seal_full_block
from asyncpaged.core.block_table import LATE_TOKEN, BlockTable, SeqId
from asyncpaged.core.kv_tiers import TierIndex
from asyncpaged.core.physical_blocks import PhysicalBlocks


def set_filled(device: PhysicalBlocks, block: int, num_slots: int) -> None:
    """Make an exclusively held block's written-slot count ``num_slots``: the slots past it
    are dead (truncated away, or a sibling's that freed the block since)."""
    device.fill(block, num_slots - device.num_filled[block])


def copy_on_write(device: PhysicalBlocks, table: BlockTable) -> tuple[tuple[int, int], ...]:
    """Move ``table`` off a partial last block that other tables hold, onto a new block; returns
    the ``(src, dst)`` copy the executor must run before writing, or ``()`` when the last block
    is full or exclusive (one block of capacity already checked)."""
    bs = device.block_size
    if not (table.num_tokens % bs and device.ref_cnt[table.block_ids[-1]] > 1):
        return ()
    src = table.block_ids[-1]
    dst = device.take(after=table.block_ids[-2] if len(table.block_ids) > 1 else None)
    # this table's slots only: after a truncation the source may hold more (a sibling's)
    device.fill(dst, table.num_tokens % bs)
    device.release((src,))
    table.block_ids[-1] = dst
    return ((src, dst),)


def write_slots(
    device: PhysicalBlocks,
    table: BlockTable,
    token_ids: Sequence[int],
    num_verified: int | None = None,
    *,
    caching: bool,
    chain: HashChain | None = None,
) -> tuple[int, ...]:
    """Reserve slots for ``token_ids`` at the end of ``table`` (capacity already checked).

    A block that fills up is hashed and registered in the prefix cache at once: the step that
    writes its last token writes the K/V of every token before any attention reads the cache;
    one filled by a :data:`LATE_TOKEN` waits for its value (:func:`set_late_token`).
    Tokens from ``num_verified`` on are speculative: a block holding one is hashed into the
    table but not registered (:meth:`BlockPool.truncate` registers it once verified).
    ``chain``: the hashes of the table's prompt when ``token_ids`` are its tokens (read, not
    computed, for the blocks they fill).
    """
    cache_end = table.num_tokens + (len(token_ids) if num_verified is None else num_verified)
    bs = device.block_size
    slots: list[int] = []
    pos, end, i = table.num_tokens, table.num_tokens + len(token_ids), 0
    while pos < end:
        offset = pos % bs
        if offset == 0:
            prev = table.block_ids[-1] if table.block_ids else None
            table.block_ids.append(device.take(after=prev))
        block = table.block_ids[-1]
        if device.num_filled[block] != offset:  # dead slots past a truncation
            set_filled(device, block, offset)
        n = min(bs - offset, end - pos)
        slots.extend(range(block * bs + offset, block * bs + offset + n))
        device.fill(block, n)
        if caching:
            table.partial_token_ids.extend(token_ids[i : i + n])
            if offset + n == bs and table.partial_token_ids[-1] != LATE_TOKEN:
                block_hash = seal_full_block(table, chain)
                if pos + n <= cache_end:
                    device.register(block, block_hash)
        pos += n
        i += n
    table.num_tokens = end
    return tuple(slots)


def allocate_table(
    device: PhysicalBlocks,
    tiers: TierIndex | None,
    seq_id: SeqId,
    token_ids: Sequence[int],
    plan: AllocationPlan,
    extra_key: str | None,
    tier_hit_tokens: dict[str, int],
    *,
    caching: bool,
) -> tuple[BlockTable, tuple[int, ...]]:
    """The table of a new sequence whose prompt is ``token_ids``, as ``plan`` says (capacity
    already checked): its cached blocks mapped in (their references raised), its tier hits
    restored after them, then slots reserved for the next uncached prompt tokens, up to
    ``plan.num_tokens``; returns (table, slot mapping)."""
    for block in plan.hit:
        device.incref(block)
    table = BlockTable(seq_id=seq_id, extra_key=extra_key, block_ids=plan.hit)
    table.block_hashes = plan.hashes
    if plan.restored:
        assert tiers is not None
        restore_from_tiers(device, tiers, table, plan.restored, tier_hit_tokens)
    num_cached = plan.num_cached_tokens
    table.num_tokens = num_cached
    new_tokens = token_ids[num_cached : plan.num_tokens]
    return table, write_slots(device, table, new_tokens, caching=caching, chain=plan.chain)


def set_late_token(device: PhysicalBlocks, table: BlockTable, token: int) -> None:
    """Give the table's :data:`LATE_TOKEN` (its last token) its value; a block it filled is
    hashed and registered in the prefix cache now (prefix caching on)."""
    partial = table.partial_token_ids
    partial[-1] = token
    if len(partial) == device.block_size:
        device.register(table.block_ids[-1], seal_full_block(table))
