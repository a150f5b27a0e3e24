"""Per-sequence block tables and the values the block pool returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncpaged.kv.prefix_hash import BlockHash

SeqId = int | str

# A token whose value a step still in flight is sampling (async scheduling): appended alone, in
# place of the real one, whose value the next transaction brings (``BlockPool.set_placeholder``).
PLACEHOLDER_TOKEN = -1


class Location(enum.Enum):
    """Where a sequence's KV blocks live.

    ``DEVICE --swap_out--> SWAPPING_OUT --complete_swap--> HOST --swap_in--> SWAPPING_IN
    --complete_swap--> DEVICE``. Only a DEVICE sequence can grow or be forked.
    """

    DEVICE = "device"
    SWAPPING_OUT = "swapping_out"
    HOST = "host"
    SWAPPING_IN = "swapping_in"

    @property
    def on_host(self) -> bool:
        """True when the table's block ids are host-pool ids."""
        return self in (Location.SWAPPING_OUT, Location.HOST)


@dataclass(slots=True, eq=False)
class BlockTable:
    """The logical-to-physical map of one sequence.

    Invariants: ``len(block_ids) == ceil(num_tokens / block_size)``; the token at position ``p``
    lives in slot ``p % block_size`` of ``block_ids[p // block_size]``. With prefix caching,
    ``block_hashes[i]`` is the chained hash of full block ``i`` (one per full block) and
    ``partial_token_ids`` holds the tokens of the partially filled last block; a last block filled
    by a :data:`PLACEHOLDER_TOKEN` stays in ``partial_token_ids`` (full, not yet hashed) until the
    token's value is set."""

    seq_id: SeqId
    extra_key: str | None
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    partial_token_ids: list[int] = field(default_factory=list)
    location: Location = Location.DEVICE

    def copy(self, seq_id: SeqId) -> BlockTable:
        return BlockTable(
            seq_id=seq_id,
            extra_key=self.extra_key,
            block_ids=self.block_ids.copy(),
            num_tokens=self.num_tokens,
            block_hashes=self.block_hashes.copy(),
            partial_token_ids=self.partial_token_ids.copy(),
            location=self.location,
        )


class SwapDirection(enum.Enum):
    OUT = "out"  # device -> host
    IN = "in"  # host -> device


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqAllocation:
    """A new sequence's table: ``num_cached_tokens`` came from the prefix cache, and
    ``slot_mapping[i]`` is the slot for prompt token ``num_cached_tokens + i``."""

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    slot_mapping: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendResult:
    """Slots for appended tokens, and the ``(src, dst)`` block copies (copy-on-write) that must
    run before those slots are written."""

    slot_mapping: tuple[int, ...]
    copy_on_write: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapPlan:
    """Blocks to copy for a swap: ``(src, dst)`` pairs, device->host for OUT, host->device for IN.

    Until :meth:`BlockPool.complete_swap` is called with ``swap_id``, both ends of every pair are
    in flight: neither free nor allocatable.
    """

    swap_id: int
    direction: SwapDirection
    seq_ids: tuple[SeqId, ...]
    block_mapping: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHit:
    """Cached device blocks that hold the first ``num_tokens`` tokens of a query."""

    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PinnedPrefix:
    """A pinned prefix: its blocks are never evicted until :meth:`BlockPool.unpin_prefix`."""

    pin_id: int
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolUsage:
    """A pool's blocks, partitioned: ``free + used + cached + in_flight == total``.

    ``used`` blocks are held by tables or pins and not in flight; ``cached`` blocks have no holder
    but stay findable by the prefix cache until evicted; ``in_flight`` blocks are the source or
    destination of an unfinished swap.
    """

    total: int
    free: int
    used: int
    cached: int
    in_flight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStatistics:
    """A snapshot of the block pool's counters."""

    block_size: int
    device: PoolUsage
    host: PoolUsage
    num_filled_device_slots: int  # written slots in held device blocks (shared blocks once)
    num_held_device_blocks: int  # used + in flight
    num_shared_device_blocks: int  # held by more than one table, pin or copy
    num_seqs: int
    num_pins: int
    num_swaps_in_flight: int
    num_cow_copies: int
    prefix_query_tokens: int
    prefix_hit_tokens: int  # all tiers: device + host + disk
    prefix_host_hit_tokens: int = 0  # restored from the host tier (kv/tiers.py)
    prefix_disk_hit_tokens: int = 0  # restored from the disk tier
    num_tier_offloads: int = 0  # evicted device blocks copied to the host tier
    num_tier_spills: int = 0  # host-tier entries written to disk

    @property
    def device_utilization(self) -> float:
        """Share of the slots of held device blocks that hold a token."""
        slots = self.num_held_device_blocks * self.block_size
        return self.num_filled_device_slots / slots if slots else 1.0
