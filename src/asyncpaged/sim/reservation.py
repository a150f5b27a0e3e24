"""Contiguous-reservation baselines (Orca Max / Pow2 / Oracle) through the real scheduler.

:class:`ReservingBlockPool` is a :class:`~asyncpaged.core.BlockPool` whose admissions must find
room for a request's whole reservation up front, as a system that reserves contiguous memory per
request does; the scheduler and the transaction code are unchanged. A request's reservation is
looked up by the ``extra_key`` of its allocation (the simulator sets the request's cache salt to
its id; prefix caching is off in this mode, so the key names the reservation and nothing else).

Accounting, per request group ``g`` (a request's sequences: forks join their parent's group)::

    outstanding(g) = max(0, reserved_blocks(g) - held_blocks(g))   reserved, not yet written
    num_blocks_to_allocate(request) = reserved_blocks(request) + sum(outstanding)

so the allocator's admission test ``need + watermark <= free`` holds exactly when the new
reservation fits beside every other request's unused reservation. Appends draw on the free
blocks, which never drop below the sum of outstanding reservations, so a request that stays
within its reservation never waits or preempts. Reservations are whole blocks: with
``block_size`` 16 an Oracle reservation is rounded up by at most 15 slots.

Contiguity (external fragmentation): a reservation also takes one contiguous extent of an
address space of ``num_device_blocks`` blocks, first fit, as a system that gives each request one
contiguous KV buffer must. A request whose reservation fits in the free blocks but in no single
free extent is refused (its need is reported as more than the pool), so it waits, FCFS, like the
others behind it. Freed extents merge with their free neighbours.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from asyncpaged.core.block_pool import BlockPool
from asyncpaged.core.block_table import AppendResult, SeqAllocation, SeqId


class ReservingBlockPool(BlockPool):
    """A block pool that admits a request only with room for its whole reservation.

    Invariants (besides :class:`BlockPool`'s): prefix caching is off, so groups share no
    blocks and ``held(g)`` is exact; ``num_outstanding_blocks`` equals the sum over live groups
    of ``max(0, reserved - held)``; after every admission the free device blocks are at least
    ``num_outstanding_blocks`` (what the admission test guarantees). The free extents are sorted,
    disjoint, never adjacent, and with the live requests' extents tile ``[0, num_device_blocks)``.
    """

    def __init__(
        self, num_device_blocks: int, num_host_blocks: int = 0, *, block_size: int = 16
    ) -> None:
        super().__init__(
            num_device_blocks, num_host_blocks, block_size=block_size, enable_prefix_caching=False
        )
        self._reserved_by_key: dict[str, int] = {}  # extra key -> reserved blocks
        self._group: dict[SeqId, str] = {}  # seq -> its request's key
        self._members: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self.num_outstanding_blocks = 0
        self._free_extents: list[tuple[int, int]] = [(0, num_device_blocks)]  # (start, length)
        self._extent: dict[str, tuple[int, int]] = {}  # key -> its contiguous extent

    def reserve(self, key: str, num_tokens: int) -> None:
        """Set the reservation of the request whose allocations carry ``extra_key == key``."""
        self._reserved_by_key[key] = -(-num_tokens // self.block_size)

    def outstanding(self, key: str) -> int:
        return max(0, self._reserved.get(key, 0) - self._held.get(key, 0))

    def num_blocks_to_allocate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        extra_key: str | None = None,
    ) -> int:
        real = super().num_blocks_to_allocate(
            token_ids, max_new_tokens=max_new_tokens, extra_key=extra_key
        )
        if extra_key is None or extra_key in self._members:
            return real  # no reservation, or an op of a request already holding one
        reserved = self._reserved_by_key.get(extra_key, 0)
        if self._first_fit(max(real, reserved)) is None:
            return self.device.num_blocks + 1  # no contiguous room: external fragmentation
        return max(real, reserved) + self.num_outstanding_blocks

    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        extra_key: str | None = None,
    ) -> SeqAllocation | None:
        before = self.num_free_device_blocks
        result = super().allocate(
            seq_id, token_ids, max_new_tokens=max_new_tokens, extra_key=extra_key
        )
        if result is None or extra_key is None:
            return result
        if extra_key not in self._members:
            self._members[extra_key] = 0
            self._held[extra_key] = 0
            self._reserved[extra_key] = self._reserved_by_key.get(extra_key, 0)
            self.num_outstanding_blocks += self._reserved[extra_key]
            size = max(self._reserved[extra_key], before - self.num_free_device_blocks)
            self._take_extent(extra_key, size)
        self._members[extra_key] += 1
        self._group[seq_id] = extra_key
        self._add_held(extra_key, before - self.num_free_device_blocks)
        return result

    def append(self, seq_id: SeqId, token_ids: Sequence[int]) -> AppendResult | None:
        before = self.num_free_device_blocks
        result = super().append(seq_id, token_ids)
        key = self._group.get(seq_id)
        if result is not None and key is not None:
            self._add_held(key, before - self.num_free_device_blocks)
        return result

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        super().fork(parent_id, child_id)
        key = self._group.get(parent_id)
        if key is not None:
            self._group[child_id] = key
            self._members[key] += 1

    def free(self, seq_id: SeqId) -> None:
        before = self.num_free_device_blocks
        super().free(seq_id)
        key = self._group.pop(seq_id, None)
        if key is None:
            return
        self._add_held(key, before - self.num_free_device_blocks)
        self._members[key] -= 1
        if self._members[key] == 0:  # the request is done (or preempted): drop its reservation
            self.num_outstanding_blocks -= self.outstanding(key)
            del self._members[key], self._held[key], self._reserved[key]
            self._release_extent(key)

    @property
    def num_fragmented_blocks(self) -> int:
        """Free address space outside the largest free extent (unusable for a reservation
        bigger than that extent)."""
        lengths = [n for _, n in self._free_extents]
        return sum(lengths) - max(lengths, default=0)

    def _first_fit(self, size: int) -> int | None:
        """Index in the free list of the first extent of at least ``size`` blocks."""
        return next((i for i, (_, n) in enumerate(self._free_extents) if n >= size), None)

    def _take_extent(self, key: str, size: int) -> None:
        index = self._first_fit(size)
        assert index is not None, "the admission check found a contiguous extent"
        start, length = self._free_extents[index]
        if length == size:
            del self._free_extents[index]
        else:
            self._free_extents[index] = (start + size, length - size)
        self._extent[key] = (start, size)

    def _release_extent(self, key: str) -> None:
        start, size = self._extent.pop(key)
        extents = self._free_extents
        i = bisect.bisect(extents, (start, 0))
        if i < len(extents) and start + size == extents[i][0]:  # merge the next one
            size += extents.pop(i)[1]
        if i > 0 and extents[i - 1][0] + extents[i - 1][1] == start:  # and the previous one
            start, size = extents[i - 1][0], extents[i - 1][1] + size
            del extents[i - 1]
            i -= 1
        extents.insert(i, (start, size))

    def _add_held(self, key: str, delta: int) -> None:
        old = self.outstanding(key)
        self._held[key] += delta
        self.num_outstanding_blocks += self.outstanding(key) - old
