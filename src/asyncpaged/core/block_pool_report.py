"""What the block pool reports about itself: its statistics, a comparable snapshot of its whole
state, and the check of every invariant of its class docstring (the last two O(pool), for
tests).

Functions of the pool and the private pieces it passes (its tables, pins, swaps in flight and
speculative tails); nothing here changes state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from asyncpaged.core.block_pool_counts import check_shared_tails, pool_usage
from asyncpaged.core.block_pool_speculative import SpeculativeTail, check_speculative_tails
from asyncpaged.core.block_pool_swap import SwapInFlight
from asyncpaged.core.block_table import BlockTable, PoolStatistics, SeqId

if TYPE_CHECKING:
    from asyncpaged.core.block_pool import BlockPool

__all__ = ["check_pool", "pool_state", "pool_statistics"]


def pool_statistics(
    pool: BlockPool, *, num_seqs: int, num_pins: int, num_swaps_in_flight: int
) -> PoolStatistics:
    """The pool's :class:`PoolStatistics` (O(1))."""
    tiers = pool.tiers
    return PoolStatistics(
        block_size=pool.block_size,
        device=pool_usage(pool.device),
        host=pool_usage(pool.host),
        num_filled_device_slots=pool.device.num_filled_held,
        num_held_device_blocks=pool.device.num_held,
        num_shared_device_blocks=pool.device.num_shared,
        num_seqs=num_seqs,
        num_pins=num_pins,
        num_swaps_in_flight=num_swaps_in_flight,
        num_cow_copies=pool.num_cow_copies,
        prefix_query_tokens=pool.prefix_query_tokens,
        prefix_hit_tokens=pool.prefix_hit_tokens,
        prefix_host_hit_tokens=pool.prefix_tier_hit_tokens["host"],
        prefix_disk_hit_tokens=pool.prefix_tier_hit_tokens["disk"],
        num_tier_offloads=tiers.num_offloads if tiers else 0,
        num_tier_spills=tiers.num_spills if tiers else 0,
    )


def pool_state(
    pool: BlockPool,
    tables: Mapping[SeqId, BlockTable],
    pins: Mapping[int, tuple[int, ...]],
    swaps: Mapping[int, SwapInFlight],
    speculative: Mapping[SeqId, SpeculativeTail],
) -> tuple[object, ...]:
    """A comparable snapshot of the whole pool (O(pool))."""
    table_states = tuple(
        (sid, t.extra_key, tuple(t.block_ids), t.num_tokens, tuple(t.block_hashes),
         tuple(t.partial_token_ids), t.location)
        for sid, t in tables.items()
    )  # fmt: skip
    swap_states = tuple((i, s.plan) for i, s in swaps.items())
    counters = (pool.num_cow_copies, pool.prefix_query_tokens, pool.prefix_hit_tokens,
                tuple(pool.prefix_tier_hit_tokens.values()))  # fmt: skip
    tiers = pool.tiers.state() if pool.tiers else ()
    return (pool.device.state(), pool.host.state(), table_states, tuple(pins.items()),
            swap_states, counters, tiers, tuple(speculative.items()))  # fmt: skip


def check_pool(
    pool: BlockPool,
    tables: Mapping[SeqId, BlockTable],
    pins: Mapping[int, tuple[int, ...]],
    swaps: Mapping[int, SwapInFlight],
    speculative: Mapping[SeqId, SpeculativeTail],
) -> None:
    """Assert every invariant of :class:`BlockPool`'s docstring (O(pool))."""
    from asyncpaged.core.pool_invariants import check_block_pool

    check_block_pool(pool, tables, pins, [s.plan for s in swaps.values()])
    if pool.tiers is not None:
        pool.tiers.check_invariants()
    check_shared_tails(pool.shared_tails(), tables, pool.device)
    check_speculative_tails(pool.device, tables, speculative, caching=pool.enable_prefix_caching)
