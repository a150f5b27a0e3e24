"""Writing a device block table: reserving slots for new tokens at its end (a block is taken
whenever the last one is full; each block that fills is hashed and, unless it holds a
speculative token, registered in the prefix cache), copy-on-write of a shared partial last
block, giving a late token its value, and a new sequence's table: as its allocation plan says
(counted in the pool's prefix statistics), or a fork's copy of its parent's. (The one-token
decode fast path, :meth:`BlockPool.append_token`, stays inline in the pool: it runs per token.)

Functions of the device pool and the tables they are given (an allocation's: of the
:class:`~asyncpaged.core.block_pool.BlockPool` itself and the tables it passes); the pool checks
the capacity and the sequence's state first, so nothing here fails for want of blocks (a fork
into an existing sequence, or a bad late token, raises before changing anything).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncpaged.core.block_pool_counts import AllocationPlan
from asyncpaged.core.block_pool_prefix import HashChain, restore_from_tiers, seal_full_block
from asyncpaged.core.block_table import LATE_TOKEN, BlockTable, SeqAllocation, SeqId
from asyncpaged.core.physical_blocks import PhysicalBlocks
from asyncpaged.errors import BlockPoolError

if TYPE_CHECKING:
    from asyncpaged.core.block_pool import BlockPool


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
    pool: BlockPool,
    tables: dict[SeqId, BlockTable],
    seq_id: SeqId,
    token_ids: Sequence[int],
    plan: AllocationPlan,
    extra_key: str | None,
) -> SeqAllocation:
    """Add to the pool's ``tables`` the table of a new sequence whose prompt is ``token_ids``,
    as ``plan`` says (capacity already checked): its cached blocks mapped in (their references
    raised), its tier hits restored after them, then slots reserved for the next uncached
    prompt tokens, up to ``plan.num_tokens``. With prefix caching, the pool's statistics count
    the prompt's tokens and its hits."""
    device, caching, num_cached = pool.device, pool.enable_prefix_caching, plan.num_cached_tokens
    if caching:
        pool.prefix_query_tokens += len(token_ids)
        pool.prefix_hit_tokens += num_cached
    for block in plan.hit:
        device.incref(block)
    table = BlockTable(seq_id=seq_id, extra_key=extra_key, block_ids=plan.hit)
    table.block_hashes = plan.hashes
    if plan.restored:
        assert pool.tiers is not None
        restore_from_tiers(device, pool.tiers, table, plan.restored, pool.prefix_tier_hit_tokens)
    table.num_tokens = num_cached
    new_tokens = token_ids[num_cached : plan.num_tokens]
    slots = write_slots(device, table, new_tokens, caching=caching, chain=plan.chain)
    tables[seq_id] = table
    return SeqAllocation(
        block_ids=tuple(table.block_ids), num_cached_tokens=num_cached, slot_mapping=slots
    )


def fork_table(
    device: PhysicalBlocks,
    tables: dict[SeqId, BlockTable],
    forked: set[SeqId],
    parent: BlockTable,
    child_id: SeqId,
) -> None:
    """Add to ``tables`` the table of ``child_id``: a copy of the device table ``parent``
    sharing every block (a reference more each; never allocates); both join ``forked``.
    Raises, changing nothing, if ``child_id`` exists."""
    if child_id in tables:
        raise BlockPoolError(f"cannot fork into {child_id!r}: that sequence already exists.")
    for block in parent.block_ids:
        device.incref(block)
    tables[child_id] = parent.copy(child_id)
    forked.update((parent.seq_id, child_id))


def set_late_token(device: PhysicalBlocks, table: BlockTable, token: int, *, caching: bool) -> None:
    """Give the table's :data:`LATE_TOKEN` (its last token) its value ``token``; a block it
    filled is hashed and registered in the prefix cache now. Raises, changing nothing, for a
    negative token, or (with prefix ``caching``) for a table whose last token is not late;
    without caching the pool keeps no tokens, so nothing changes."""
    if token < 0:
        raise BlockPoolError(f"token ids must be >= 0, got {token}.")
    if not caching:
        return
    partial = table.partial_token_ids
    if not partial or partial[-1] != LATE_TOKEN:
        raise BlockPoolError(f"sequence {table.seq_id!r} has no late token to set.")
    partial[-1] = token
    if len(partial) == device.block_size:
        device.register(table.block_ids[-1], seal_full_block(table))
