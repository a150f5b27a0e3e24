"""Contiguous-reservation baselines (Orca Max / Pow2 / Oracle) through the real scheduler.

:class:`ReservingBlockPool` is a :class:`BlockPool` whose admissions must find
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
others behind it. Freed extents merge with their free neighbours. With ``placement="buddy"``
(the simulator's default: the vLLM paper's reimplementation of Orca places each request's KV
with the buddy allocation algorithm, §6.1) the extent is the reservation rounded up to a power of
two, split from and merged back into power-of-two buddies (:class:`BuddySpace`); the rounding is
internal fragmentation that no other request can use.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Literal

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import AppendResult, SeqAllocation, SeqId

Placement = Literal["first-fit", "buddy"]


class ReservingBlockPool(BlockPool):
    """A block pool that admits a request only with room for its whole reservation.

    Invariants (besides :class:`BlockPool`'s): prefix caching is off, so groups share no
    blocks and ``held(g)`` is exact; ``num_outstanding_blocks`` equals the sum over live groups
    of ``max(0, reserved - held)``; after every admission the free device blocks are at least
    ``num_outstanding_blocks`` (what the admission test guarantees). The free extents are sorted,
    disjoint, never adjacent, and with the live requests' extents tile ``[0, num_device_blocks)``.
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        *,
        block_size: int = 16,
        placement: Placement = "buddy",
    ) -> None:
        super().__init__(
            num_device_blocks, num_host_blocks, block_size=block_size, enable_prefix_caching=False
        )
        self._buddy = BuddySpace(num_device_blocks) if placement == "buddy" else None
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
        read_cache: bool = True,
    ) -> int:
        real = super().num_blocks_to_allocate(
            token_ids, max_new_tokens=max_new_tokens, extra_key=extra_key, read_cache=read_cache
        )
        if extra_key is None or extra_key in self._members:
            return real  # no reservation, or an op of a request already holding one
        reserved = self._reserved_by_key.get(extra_key, 0)
        if not self._fits(max(real, reserved)):
            return self.device.num_blocks + 1  # no contiguous room: external fragmentation
        return max(real, reserved) + self.num_outstanding_blocks

    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        extra_key: str | None = None,
        read_cache: bool = True,
    ) -> SeqAllocation | None:
        before = self.num_free_device_blocks
        result = super().allocate(
            seq_id,
            token_ids,
            max_new_tokens=max_new_tokens,
            extra_key=extra_key,
            read_cache=read_cache,
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

    def append(
        self, seq_id: SeqId, token_ids: Sequence[int], *, num_speculative_tokens: int = 0
    ) -> AppendResult | None:
        before = self.num_free_device_blocks
        result = super().append(seq_id, token_ids, num_speculative_tokens=num_speculative_tokens)
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
        extents = self._buddy.free_extents() if self._buddy else self._free_extents
        lengths = [n for _, n in extents]
        return sum(lengths) - max(lengths, default=0)

    def _fits(self, size: int) -> bool:
        if self._buddy is not None:
            return self._buddy.fits(size)
        return self._first_fit(size) is not None

    def _first_fit(self, size: int) -> int | None:
        """Index in the free list of the first extent of at least ``size`` blocks."""
        return next((i for i, (_, n) in enumerate(self._free_extents) if n >= size), None)

    def _take_extent(self, key: str, size: int) -> None:
        if self._buddy is not None:
            self._extent[key] = self._buddy.take(size)
            return
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
        if self._buddy is not None:
            self._buddy.release(start, size)
            return
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


class BuddySpace:
    """A binary buddy allocator over an address space of ``size`` blocks.

    A request of ``n`` blocks takes an aligned extent of the next power of two (the rest of it
    is internal fragmentation), split from the smallest free extent that holds it (lowest
    address first); a freed extent merges with its free buddy. A space that is not a power of two
    is the aligned power-of-two arenas of its binary digits, largest first, which never merge.

    Invariants: free extents are aligned to their size, disjoint, inside one arena each, and no
    free extent's buddy (inside its arena) is free at the same size.
    """

    def __init__(self, size: int) -> None:
        self._free: dict[int, list[int]] = {}  # extent size -> sorted free start addresses
        self._arenas: list[tuple[int, int]] = []  # (start, size), by start
        start = 0
        for bit in reversed(range(size.bit_length())):
            if size >> bit & 1:
                self._arenas.append((start, 1 << bit))
                self._free.setdefault(1 << bit, []).append(start)
                start += 1 << bit

    def free_extents(self) -> list[tuple[int, int]]:
        """The free (start, size) extents, by start."""
        return sorted((start, k) for k, starts in self._free.items() for start in starts)

    def fits(self, n: int) -> bool:
        want = _pow2(n)
        return any(k >= want and starts for k, starts in self._free.items())

    def take(self, n: int) -> tuple[int, int]:
        """The (start, size) of a new extent for ``n`` blocks; the caller checked :meth:`fits`."""
        want = _pow2(n)
        size = min(k for k, starts in self._free.items() if k >= want and starts)
        start = self._free[size].pop(0)
        while size > want:  # split, keeping the lower half
            size //= 2
            bisect.insort(self._free.setdefault(size, []), start + size)
        return start, size

    def release(self, start: int, size: int) -> None:
        arena_start, arena_size = self._arenas[bisect.bisect(self._arenas, (start, 1 << 62)) - 1]
        while size < arena_size:
            buddy = arena_start + ((start - arena_start) ^ size)
            starts = self._free.get(size, [])
            i = bisect.bisect_left(starts, buddy)
            if i == len(starts) or starts[i] != buddy:
                break
            del starts[i]
            start, size = min(start, buddy), size * 2
        bisect.insort(self._free.setdefault(size, []), start)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
