"""The swaps in flight of a block pool: each started swap's plan and the tables it moves, until
:meth:`BlockPool.complete_swap` says its copies are done.

:class:`SwapsInFlight` is a class of its own, held by the
:class:`~asyncpaged.kv.block_pool.BlockPool`: the records outlive the call that starts a swap,
and the queries over them (the blocks a swap releases when it completes) read only them and the
pools' public counts. Moving tables between the pools changes the pool's tables and blocks, so
starting and completing a swap stay methods of the pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from asyncpaged.errors import BlockPoolError
from asyncpaged.kv.block_table import BlockTable, SwapDirection, SwapPlan
from asyncpaged.kv.physical_blocks import PhysicalBlocks

__all__ = ["SwapInFlight", "SwapsInFlight"]


@dataclass(slots=True)
class SwapInFlight:
    """A swap whose copies run: its plan and the tables it moves, in the group's order."""

    plan: SwapPlan
    tables: tuple[BlockTable, ...]


class SwapsInFlight:
    """The swaps started and not yet completed, by swap id (in the order they started).

    Both ends of every ``(src, dst)`` pair of a swap in flight are held in flight in their pools
    (:meth:`PhysicalBlocks.hold_in_flight`); the pool checks that against these records.
    """

    def __init__(self, device: PhysicalBlocks, host: PhysicalBlocks) -> None:
        self.device = device
        self.host = host
        self._swaps: dict[int, SwapInFlight] = {}

    def __len__(self) -> int:
        return len(self._swaps)

    def __iter__(self) -> Iterator[SwapInFlight]:
        return iter(self._swaps.values())

    def add(self, plan: SwapPlan, tables: tuple[BlockTable, ...]) -> None:
        self._swaps[plan.swap_id] = SwapInFlight(plan=plan, tables=tables)

    def get(self, swap_id: int) -> SwapInFlight:
        """The swap in flight with this id; raises for any other id."""
        if swap_id not in self._swaps:
            raise BlockPoolError(f"no swap in flight with id {swap_id}.")
        return self._swaps[swap_id]

    def pop(self, swap_id: int) -> SwapInFlight:
        """Remove and return the swap in flight with this id; raises for any other id."""
        swap = self.get(swap_id)
        del self._swaps[swap_id]
        return swap

    def pools(self, direction: SwapDirection) -> tuple[PhysicalBlocks, PhysicalBlocks]:
        """(source, destination) of a swap in ``direction``."""
        if direction is SwapDirection.OUT:
            return self.device, self.host
        return self.host, self.device

    def num_blocks_freed(self, swap_id: int) -> int:
        """Source blocks that completing swap ``swap_id`` would release (their only holder is
        it)."""
        plan = self.get(swap_id).plan
        src = self.pools(plan.direction)[0]
        return sum(1 for b, _ in plan.block_mapping if src.ref_cnt[b] == src.in_flight[b])

    def num_blocks_coming(self) -> int:
        """Device blocks that the swap-outs in flight release when their copies complete."""
        device = self.device
        blocks = {  # a block two swap-outs copy (shared by their groups) is counted once
            b
            for swap in self._swaps.values()
            if swap.plan.direction is SwapDirection.OUT
            for b, _ in swap.plan.block_mapping
        }
        return sum(1 for b in blocks if device.ref_cnt[b] == device.in_flight[b])

    def state(self) -> tuple[object, ...]:
        """A comparable snapshot: (swap id, plan) of each swap in flight."""
        return tuple((i, s.plan) for i, s in self._swaps.items())
