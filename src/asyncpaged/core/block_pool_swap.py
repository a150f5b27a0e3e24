"""Swap bookkeeping of the block pool: checking a swap group, moving its tables onto new blocks
of the other pool with both ends of every copy held in flight, recording the swap in flight,
finishing the moves once the copies are done, and counting the source blocks that swaps in
flight release.

Functions of the pools, the tables and the swaps in flight they are given (the
:class:`~asyncpaged.core.block_pool.BlockPool` passes its own, and the iterator of its ids).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from asyncpaged.core.block_pool_checks import check_settled, table_of
from asyncpaged.core.block_pool_prefix import register_full_blocks
from asyncpaged.core.block_pool_speculative import check_verified
from asyncpaged.core.block_table import BlockTable, Location, SeqId, SwapDirection, SwapPlan
from asyncpaged.core.physical_blocks import PhysicalBlocks
from asyncpaged.errors import BlockPoolError


@dataclass(slots=True)
class SwapInFlight:
    """A swap whose copies run: its plan and the tables it moves, in the group's order."""

    plan: SwapPlan
    tables: tuple[BlockTable, ...]


def distinct_blocks(tables: Iterable[BlockTable]) -> list[int]:
    """The blocks the tables hold, each once, in first-seen order."""
    return list(dict.fromkeys(b for t in tables for b in t.block_ids))


def swap_group(
    tables: Mapping[SeqId, BlockTable],
    speculative: Container[SeqId],
    seq_ids: Sequence[SeqId],
    direction: SwapDirection,
) -> tuple[BlockTable, ...]:
    """The tables of a group that can swap in ``direction``; raises :class:`BlockPoolError` for
    an empty group, an unknown or repeated sequence, one in the wrong place or one holding
    speculative tokens."""
    if not seq_ids:
        raise BlockPoolError("a swap needs at least one sequence.")
    if len(set(seq_ids)) != len(seq_ids):
        raise BlockPoolError(f"duplicate sequence ids in swap group {list(seq_ids)!r}.")
    want = Location.DEVICE if direction is SwapDirection.OUT else Location.HOST
    group = tuple(table_of(tables, sid) for sid in seq_ids)
    for table in group:
        if table.location is not want:
            raise BlockPoolError(
                f"cannot swap {direction.value} sequence {table.seq_id!r}: it is "
                f"{table.location.value}, not {want.value}."
            )
        check_verified(speculative, table.seq_id, "swap out")
    return group


def move_tables(
    src: PhysicalBlocks,
    dst: PhysicalBlocks,
    tables: tuple[BlockTable, ...],
    direction: SwapDirection,
) -> dict[int, int] | None:
    """Map every block of the tables to a new ``dst`` block (a block shared inside the group
    once), hold both ends in flight and move the tables to the swapping location; returns the
    mapping, or None, changing nothing, when ``dst`` is short."""
    blocks = distinct_blocks(tables)
    if len(blocks) > dst.num_allocatable:
        return None
    mapping: dict[int, int] = {}
    prev: int | None = None
    for block in blocks:
        prev = mapping[block] = dst.take(after=prev)
        dst.mark_in_flight(prev)
        dst.fill(prev, src.num_filled[block])
        src.hold_in_flight(block)
    out = direction is SwapDirection.OUT
    for table in tables:
        for block in table.block_ids:
            dst.incref(mapping[block])
        src.release(table.block_ids)
        table.block_ids = [mapping[b] for b in table.block_ids]
        table.location = Location.SWAPPING_OUT if out else Location.SWAPPING_IN
    return mapping


def start_swap(
    device: PhysicalBlocks,
    host: PhysicalBlocks,
    tables: Mapping[SeqId, BlockTable],
    speculative: Container[SeqId],
    swaps: dict[int, SwapInFlight],
    ids: Iterator[int],
    seq_ids: Sequence[SeqId],
    direction: SwapDirection,
    *,
    caching: bool,
) -> SwapPlan | None:
    """Start the swap of a group in ``direction``: checked (:func:`swap_group`, and no late
    token), its tables moved (:func:`move_tables`), and recorded in ``swaps`` under the next
    id of ``ids``; returns its plan, or None, changing nothing, when the destination pool is
    short."""
    group = swap_group(tables, speculative, seq_ids, direction)
    for table in group:
        check_settled(table, "swap", caching=caching)
    src, dst = swap_pools(device, host, direction)
    mapping = move_tables(src, dst, group, direction)
    if mapping is None:
        return None
    plan = SwapPlan(
        swap_id=next(ids),
        direction=direction,
        seq_ids=tuple(seq_ids),
        block_mapping=tuple(mapping.items()),
    )
    swaps[plan.swap_id] = SwapInFlight(plan=plan, tables=group)
    return plan


def in_flight(swaps: Mapping[int, SwapInFlight], swap_id: int) -> SwapInFlight:
    """The swap in flight with this id; raises for any other id."""
    if swap_id not in swaps:
        raise BlockPoolError(f"no swap in flight with id {swap_id}.")
    return swaps[swap_id]


def complete_swap(
    device: PhysicalBlocks,
    host: PhysicalBlocks,
    swaps: dict[int, SwapInFlight],
    tables: Mapping[SeqId, BlockTable],
    swap_id: int,
    *,
    caching: bool,
) -> None:
    """The copies of swap ``swap_id`` are done: drop it from ``swaps``, release its in-flight
    holds and settle its tables that are still in ``tables`` (a table freed while the copy ran
    is skipped); a table swapped in registers its full blocks in the prefix cache again (with
    ``caching``)."""
    swap = in_flight(swaps, swap_id)
    del swaps[swap_id]
    src, dst = swap_pools(device, host, swap.plan.direction)
    out = swap.plan.direction is SwapDirection.OUT
    src.release_in_flight(s for s, _ in swap.plan.block_mapping)
    dst.release_in_flight(d for _, d in swap.plan.block_mapping)
    for table in swap.tables:
        if tables.get(table.seq_id) is not table:
            continue  # freed while the copy ran
        table.location = Location.HOST if out else Location.DEVICE
        if not out and caching:
            register_full_blocks(dst, table)


def num_blocks_freed(
    device: PhysicalBlocks, host: PhysicalBlocks, swaps: Mapping[int, SwapInFlight], swap_id: int
) -> int:
    """Source blocks that completing swap ``swap_id`` would release (their only holder is it)."""
    plan = in_flight(swaps, swap_id).plan
    src = swap_pools(device, host, plan.direction)[0]
    return sum(1 for b, _ in plan.block_mapping if src.ref_cnt[b] == src.in_flight[b])


def num_blocks_coming(device: PhysicalBlocks, swaps: Iterable[SwapInFlight]) -> int:
    """Device blocks that the swap-outs among ``swaps`` release when their copies complete."""
    blocks = {  # a block two swap-outs copy (shared by their groups) is counted once
        b
        for swap in swaps
        if swap.plan.direction is SwapDirection.OUT
        for b, _ in swap.plan.block_mapping
    }
    return sum(1 for b in blocks if device.ref_cnt[b] == device.in_flight[b])


def swap_pools(
    device: PhysicalBlocks, host: PhysicalBlocks, direction: SwapDirection
) -> tuple[PhysicalBlocks, PhysicalBlocks]:
    """(source, destination) of a swap in ``direction``."""
    if direction is SwapDirection.OUT:
        return device, host
    return host, device
