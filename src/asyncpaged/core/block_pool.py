"""The paged KV block pool: block tables, sharing, copy-on-write, swap, and the prefix cache.

Synchronous and pure Python: the allocator actor wraps it, tests drive it directly. Shortage is a
value (``None``); a call that is invalid in the current state raises :class:`BlockPoolError` before
changing anything; a broken internal invariant is an ``AssertionError``.

::

    seq "a" table: [ 7 | 8 | 3 ]      device pool (block_size 4, slot = block * 4 + offset)
                    \\   \\    \\___    block 7: t0 t1 t2 t3   full, hashed -> prefix cache
    seq "b" table: [ 7 | 8 | 5 ]      block 8: t4 t5 t6 t7   full, shared by a and b (ref 2)
                                      block 3: t8 t9 .  .    a's partial block (ref 1)
                                      block 5: t8 u9 .  .    b's copy-on-write of the old shared 3
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from asyncpaged.core.block_table import (
    AppendResult,
    BlockTable,
    Location,
    PinnedPrefix,
    PoolStatistics,
    PoolUsage,
    PrefixHit,
    SeqAllocation,
    SeqId,
    SwapDirection,
    SwapPlan,
)
from asyncpaged.core.kv_tiers import TierIndex, TierOp
from asyncpaged.core.physical_blocks import PhysicalBlocks
from asyncpaged.core.prefix_hash import ROOT_HASH, BlockHash, hash_block
from asyncpaged.errors import BlockPoolError


@dataclass(slots=True)
class _Swap:
    plan: SwapPlan
    tables: tuple[BlockTable, ...]


@dataclass(frozen=True, slots=True)
class _SpeculativeTail:
    """A sequence's unverified tokens: positions ``start ..`` its end. ``known_tokens`` are
    the tokens from ``known_start`` (the first block holding a speculative token) to the end,
    kept so that :meth:`BlockPool.truncate` can rebuild a partial last block's tokens (only with
    prefix caching; empty otherwise)."""

    start: int
    known_start: int
    known_tokens: tuple[int, ...]


class BlockPool:
    """Device and host block pools with per-sequence block tables.

    Invariants (:meth:`check_invariants` asserts them all):

    * A block's reference count equals the number of block tables that hold it, plus the pins
      that hold it, plus the swaps in flight that copy from or into it. A table never holds a
      block twice.
    * Each pool's blocks partition into free, used, cached (device only) and in flight.
    * In-flight blocks are never free or evictable, so no allocation hands them out.
    * ``len(table.block_ids) == ceil(table.num_tokens / block_size)``: a new block is taken only
      when the last one is full, so a sequence wastes less than one block.
    * A partial last block that another table shares is copied before it is written
      (copy-on-write), so a write never changes what another sequence reads.
    * Only full device blocks are registered in the prefix cache, under the chained hash of their
      tokens and extra key; the last token of a prompt is never served from the cache.
    * Only forks share a partial block, so every device table whose partial last block has
      another holder is in ``_forked`` (tables created by or forked from :meth:`fork`, or
      truncated into a shared block; dropped at :meth:`free`); :meth:`shared_tails` checks
      those alone.
    * Speculative slots (``append(..., num_speculative_tokens=k)``): a block holding a token
      not yet verified is never registered in the prefix cache. :meth:`truncate` drops the
      rejected tail (a block left empty is released; a block left partial keeps its other
      holders' slots, and a shared one is copied on the next append) and registers the full
      blocks the kept tokens complete, so a rejected token never enters the prefix cache.
      Until then the sequence can neither grow, fork nor swap out.
    * With ``tiers`` (core/kv_tiers.py), every cached block evicted from the device is handed to
      the tier index before it is reused, and a block restored from a tier is a new device block
      registered under its hash at once; the tier copies of a transaction run before its step.
    * Every operation is O(blocks touched), never O(pool size), except the test-only
      :meth:`check_invariants`, :meth:`state` and the shutdown-only :meth:`persist_tiers`.
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        *,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        tiers: TierIndex | None = None,
    ) -> None:
        """``tiers``: the host and disk KV tiers below the prefix cache (core/kv_tiers.py):
        evicted cached blocks are offloaded there, and allocations restore from there."""
        if num_device_blocks < 1 or num_host_blocks < 0 or block_size < 1:
            raise ValueError(
                f"need num_device_blocks >= 1, num_host_blocks >= 0 and block_size >= 1, got "
                f"{num_device_blocks}, {num_host_blocks} and {block_size}."
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.device = PhysicalBlocks(num_device_blocks, block_size, cacheable=enable_prefix_caching)
        self.host = PhysicalBlocks(num_host_blocks, block_size, cacheable=False)
        self._tables: dict[SeqId, BlockTable] = {}
        self._pins: dict[int, tuple[int, ...]] = {}
        self._swaps: dict[int, _Swap] = {}
        self._forked: set[SeqId] = set()
        self._speculative: dict[SeqId, _SpeculativeTail] = {}
        self._ids = itertools.count()
        self.num_cow_copies = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_tier_hit_tokens = {"host": 0, "disk": 0}
        self.tiers = tiers if enable_prefix_caching else None
        if self.tiers is not None:
            self.device.on_evict = self.tiers.offload

    # ---- queries (no side effects) --------------------------------------------------------

    @property
    def num_free_device_blocks(self) -> int:
        """Device blocks an allocation can take now (free, or cached and evictable)."""
        return self.device.num_allocatable

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_allocatable

    def tables(self) -> Mapping[SeqId, BlockTable]:
        """A read-only view of every block table (do not mutate the tables)."""
        return MappingProxyType(self._tables)

    def pins(self) -> Mapping[int, tuple[int, ...]]:
        """A read-only view of the pinned prefixes: pin id -> its device blocks."""
        return MappingProxyType(self._pins)

    def shared_tails(self) -> frozenset[SeqId]:
        """Device sequences whose partial last block is shared: their next append copies it."""
        if not self._forked:
            return frozenset()
        bs, ref_cnt, tables = self.block_size, self.device.ref_cnt, self._tables
        return frozenset(
            sid
            for sid in self._forked
            if (table := tables[sid]).location is Location.DEVICE
            and table.num_tokens % bs
            and ref_cnt[table.block_ids[-1]] > 1
        )

    def release_counts(self, seq_ids: Sequence[SeqId]) -> tuple[int, int] | None:
        """(blocks that freeing the group would release, distinct blocks it holds), or None
        unless every sequence of the group is on the device."""
        tables = self._tables
        ref_cnt = self.device.ref_cnt
        if len(seq_ids) == 1:  # the common case: a block of one table is exclusive at refcount 1
            table = tables.get(seq_ids[0])
            if table is None or table.location is not Location.DEVICE:
                return None
            return operator.countOf(map(ref_cnt.__getitem__, table.block_ids), 1), len(
                table.block_ids
            )
        holders: dict[int, int] = {}
        for sid in seq_ids:
            table = tables.get(sid)
            if table is None or table.location is not Location.DEVICE:
                return None
            for b in table.block_ids:
                holders[b] = holders.get(b, 0) + 1
        exclusive = sum(1 for b, n in holders.items() if ref_cnt[b] == n)
        return exclusive, len(holders)

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def block_ids(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(self._table(seq_id).block_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._table(seq_id).num_tokens

    def location(self, seq_id: SeqId) -> Location:
        return self._table(seq_id).location

    def lookup_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> PrefixHit:
        """The cached full blocks that a prompt ``token_ids`` would reuse (never its last token)."""
        blocks, _ = self._match_prefix(token_ids, extra_key)
        return PrefixHit(block_ids=tuple(blocks), num_tokens=len(blocks) * self.block_size)

    def num_blocks_to_allocate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        extra_key: str | None = None,
        read_cache: bool = True,
    ) -> int:
        """Allocatable device blocks that :meth:`allocate` with these arguments would consume."""
        _check_tokens(token_ids)
        hit, hashes = self._match_prefix(token_ids, extra_key, None if read_cache else 0)
        restored = self._match_tiers(token_ids, extra_key, hashes) if read_cache else []
        num_hit = len(hit) + len(restored)
        num_tokens = self._num_tokens_after_allocate(token_ids, num_hit, max_new_tokens)
        num_new_blocks = -(-num_tokens // self.block_size) - len(hit)
        return num_new_blocks + sum(1 for b in hit if self.device.ref_cnt[b] == 0)

    def can_allocate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        extra_key: str | None = None,
    ) -> bool:
        need = self.num_blocks_to_allocate(
            token_ids, max_new_tokens=max_new_tokens, extra_key=extra_key
        )
        return need <= self.device.num_allocatable

    def num_blocks_to_append(self, seq_id: SeqId, num_tokens: int) -> int:
        """Device blocks that appending ``num_tokens`` tokens takes, copy-on-write included."""
        table = self._device_table(seq_id, "append to")
        return self._blocks_to_append(table, num_tokens)

    def num_blocks_to_append_all(self, appends: Sequence[tuple[SeqId, int]]) -> int:
        """Device blocks that these appends (sequence, number of tokens), run in order, take:
        exact for siblings sharing a partial last block (the last of its holders to append
        writes in place, the others copy it)."""
        bs, ref_cnt = self.block_size, self.device.ref_cnt
        copied: dict[int, int] = {}  # shared tail block -> holders that copied it away so far
        need = 0
        for seq_id, num_tokens in appends:
            table = self._device_table(seq_id, "append to")
            need += -(-(table.num_tokens + num_tokens) // bs) - len(table.block_ids)
            if table.num_tokens % bs:
                tail = table.block_ids[-1]
                if ref_cnt[tail] - copied.get(tail, 0) > 1:
                    need += 1
                    copied[tail] = copied.get(tail, 0) + 1
        return need

    @property
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

    def can_append(self, seq_id: SeqId, num_tokens: int = 1) -> bool:
        return self.num_blocks_to_append(seq_id, num_tokens) <= self.device.num_allocatable

    def num_blocks_to_swap(self, seq_ids: Sequence[SeqId], direction: SwapDirection) -> int:
        """Blocks a swap of this group takes in the destination pool (shared blocks once)."""
        tables = self._swap_tables(seq_ids, direction)
        return len(_distinct_blocks(tables))

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        need = self.num_blocks_to_swap(seq_ids, SwapDirection.OUT)
        return need <= self.host.num_allocatable

    def can_swap_in(self, seq_ids: Sequence[SeqId]) -> bool:
        need = self.num_blocks_to_swap(seq_ids, SwapDirection.IN)
        return need <= self.device.num_allocatable

    # ---- growing and sharing --------------------------------------------------------------

    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        extra_key: str | None = None,
        read_cache: bool = True,
    ) -> SeqAllocation | None:
        """Create the table of a new sequence whose prompt is ``token_ids``.

        Cached full blocks of the prompt (never its last token) are mapped in and their reference
        counts raised; then slots are reserved for the next uncached prompt tokens, at most
        ``max_new_tokens`` of them (a prefill chunk; None means the whole rest). Returns None, and
        changes nothing, when the device pool is short. ``read_cache=False`` maps no cached
        block (every token is computed: prompt logprobs need them all); the sequence's full
        blocks are still registered for others.
        """
        if seq_id in self._tables:
            raise BlockPoolError(f"sequence {seq_id!r} already exists.")
        _check_tokens(token_ids)
        hit, hashes = self._match_prefix(token_ids, extra_key, None if read_cache else 0)
        restored = self._match_tiers(token_ids, extra_key, hashes) if read_cache else []
        num_hit = len(hit) + len(restored)
        num_cached = num_hit * self.block_size
        num_tokens = self._num_tokens_after_allocate(token_ids, num_hit, max_new_tokens)
        num_new_blocks = -(-num_tokens // self.block_size) - len(hit)
        need = num_new_blocks + sum(1 for b in hit if self.device.ref_cnt[b] == 0)
        if need > self.device.num_allocatable:
            return None
        if self.enable_prefix_caching:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += num_cached
        for block in hit:
            self.device.incref(block)
        table = BlockTable(seq_id=seq_id, extra_key=extra_key, block_ids=hit)
        table.block_hashes = hashes
        if restored:
            self._restore(table, restored)
        table.num_tokens = num_cached
        slots = self._write(table, token_ids[num_cached:num_tokens])
        self._tables[seq_id] = table
        return SeqAllocation(
            block_ids=tuple(table.block_ids), num_cached_tokens=num_cached, slot_mapping=slots
        )

    def append(
        self, seq_id: SeqId, token_ids: Sequence[int], *, num_speculative_tokens: int = 0
    ) -> AppendResult | None:
        """Reserve slots for ``token_ids`` at the end of a device-resident sequence.

        A shared partial last block is copied first (copy-on-write): the result names the
        ``(src, dst)`` pair the executor must copy before writing. Returns None, and changes
        nothing, when the device pool is short.

        The last ``num_speculative_tokens`` tokens are proposals to verify: no block holding one
        is registered in the prefix cache, and the sequence must be :meth:`truncate`-d (to the
        tokens it keeps) before it grows, forks or swaps out again.
        """
        table = self._device_table(seq_id, "append to")
        _check_tokens(token_ids)
        if not 0 <= num_speculative_tokens <= len(token_ids):
            raise BlockPoolError(
                f"num_speculative_tokens must be in [0, {len(token_ids)}], got "
                f"{num_speculative_tokens}."
            )
        self._check_verified(seq_id, "append to")
        if self._blocks_to_append(table, len(token_ids)) > self.device.num_allocatable:
            return None
        cow: tuple[tuple[int, int], ...] = ()
        if table.num_tokens % self.block_size and self.device.ref_cnt[table.block_ids[-1]] > 1:
            src = table.block_ids[-1]
            dst = self.device.take(after=table.block_ids[-2] if len(table.block_ids) > 1 else None)
            # this table's slots only: after a truncation the source may hold more (a sibling's)
            self.device.fill(dst, table.num_tokens % self.block_size)
            self.device.release((src,))
            table.block_ids[-1] = dst
            self.num_cow_copies += 1
            cow = ((src, dst),)
        if num_speculative_tokens:
            self._speculative[seq_id] = self._speculative_tail(
                table, token_ids, num_speculative_tokens
            )
        slots = self._write(table, token_ids, len(token_ids) - num_speculative_tokens)
        return AppendResult(slot_mapping=slots, copy_on_write=cow)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give ``child_id`` the parent's table, sharing every block (never allocates)."""
        parent = self._device_table(parent_id, "fork")
        self._check_verified(parent_id, "fork")
        if child_id in self._tables:
            raise BlockPoolError(f"cannot fork into {child_id!r}: that sequence already exists.")
        for block in parent.block_ids:
            self.device.incref(block)
        self._tables[child_id] = parent.copy(child_id)
        self._forked.update((parent_id, child_id))

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence and its references, tail first, wherever its blocks are.

        Blocks of a swap in flight stay held by the swap until :meth:`complete_swap`.
        """
        table = self._table(seq_id)
        del self._tables[seq_id]
        self._forked.discard(seq_id)
        self._speculative.pop(seq_id, None)
        self._pool_of(table).release(table.block_ids)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> tuple[int, ...]:
        """Drop a device sequence's tokens after the first ``num_tokens`` (rejected proposals);
        returns the blocks it no longer holds, in table order (released tail first: a cached one
        stays in the prefix cache, an uncached one is free again unless another table holds it).

        Ends the speculative tail of :meth:`append`: the kept tokens are verified, and the full
        blocks they complete are registered in the prefix cache now (call this once the step
        that wrote those slots is done). ``num_tokens`` equal to the length keeps everything.
        The kept part of a block shared with a fork is not touched: this sequence's next append
        copies it first. With prefix caching the pool must still know the tokens of the new
        last block: ``num_tokens`` is a multiple of the block size, or lies in the last block
        or in the blocks of the speculative tail; otherwise :class:`BlockPoolError`. Never
        allocates.
        """
        table = self._device_table(seq_id, "truncate")
        bs = self.block_size
        if not 1 <= num_tokens <= table.num_tokens:
            raise BlockPoolError(
                f"cannot truncate sequence {seq_id!r} to {num_tokens} tokens: it has "
                f"{table.num_tokens} (keep at least 1)."
            )
        tail = self._speculative.get(seq_id)
        partial = self._kept_partial_tokens(table, tail, num_tokens)
        self._speculative.pop(seq_id, None)
        keep = -(-num_tokens // bs)
        dropped = tuple(table.block_ids[keep:])
        del table.block_ids[keep:]
        self.device.release(dropped)
        if num_tokens % bs:
            self._truncate_last_block(table, num_tokens)
        table.num_tokens = num_tokens
        if self.enable_prefix_caching:
            del table.block_hashes[num_tokens // bs :]
            table.partial_token_ids = partial
            if tail is not None:  # the kept proposals are verified: cache their full blocks
                for i in range(tail.start // bs, num_tokens // bs):
                    if self.device.hash_of(table.block_ids[i]) is None:
                        self.device.register(table.block_ids[i], table.block_hashes[i])
        return dropped

    def has_speculative_tokens(self, seq_id: SeqId) -> bool:
        """Whether the sequence holds proposals not yet verified (see :meth:`truncate`)."""
        self._table(seq_id)
        return seq_id in self._speculative

    # ---- swap -----------------------------------------------------------------------------

    def swap_out(self, seq_ids: Sequence[SeqId]) -> SwapPlan | None:
        """Map every device block of a sequence group to a new host block, all or nothing.

        Blocks shared inside the group get one host block, so the sharing survives. The group
        moves to SWAPPING_OUT; both ends of each copy stay in flight until :meth:`complete_swap`.
        Returns None, and changes nothing, when the host pool is short.
        """
        return self._swap(seq_ids, SwapDirection.OUT)

    def swap_in(self, seq_ids: Sequence[SeqId]) -> SwapPlan | None:
        """The reverse of :meth:`swap_out`, for a group on the host; None if the device is short."""
        return self._swap(seq_ids, SwapDirection.IN)

    def num_blocks_freed_by_swap(self, swap_id: int) -> int:
        """Source blocks that completing this swap would release (their only holder is it)."""
        if swap_id not in self._swaps:
            raise BlockPoolError(f"no swap in flight with id {swap_id}.")
        plan = self._swaps[swap_id].plan
        src = self.device if plan.direction is SwapDirection.OUT else self.host
        return sum(1 for b, _ in plan.block_mapping if src.ref_cnt[b] == src.in_flight[b])

    def complete_swap(self, swap_id: int) -> None:
        """The copies of a swap are done: release the in-flight holds, finish the moves."""
        if swap_id not in self._swaps:
            raise BlockPoolError(f"no swap in flight with id {swap_id}.")
        swap = self._swaps.pop(swap_id)
        out = swap.plan.direction is SwapDirection.OUT
        src, dst = (self.device, self.host) if out else (self.host, self.device)
        src.release_in_flight(s for s, _ in swap.plan.block_mapping)
        dst.release_in_flight(d for _, d in swap.plan.block_mapping)
        for table in swap.tables:
            if self._tables.get(table.seq_id) is not table:
                continue  # freed while the copy ran
            table.location = Location.HOST if out else Location.DEVICE
            if not out and self.enable_prefix_caching:
                for block, block_hash in zip(table.block_ids, table.block_hashes, strict=False):
                    if self.device.hash_of(block) is None:
                        self.device.register(block, block_hash)

    def _swap(self, seq_ids: Sequence[SeqId], direction: SwapDirection) -> SwapPlan | None:
        tables = self._swap_tables(seq_ids, direction)
        out = direction is SwapDirection.OUT
        src, dst = (self.device, self.host) if out else (self.host, self.device)
        blocks = _distinct_blocks(tables)
        if len(blocks) > dst.num_allocatable:
            return None
        mapping: dict[int, int] = {}
        prev: int | None = None
        for block in blocks:
            prev = mapping[block] = dst.take(after=prev)
            dst.mark_in_flight(prev)
            dst.fill(prev, src.num_filled[block])
            src.hold_in_flight(block)
        for table in tables:
            for block in table.block_ids:
                dst.incref(mapping[block])
            src.release(table.block_ids)
            table.block_ids = [mapping[b] for b in table.block_ids]
            table.location = Location.SWAPPING_OUT if out else Location.SWAPPING_IN
        plan = SwapPlan(
            swap_id=next(self._ids),
            direction=direction,
            seq_ids=tuple(seq_ids),
            block_mapping=tuple(mapping.items()),
        )
        self._swaps[plan.swap_id] = _Swap(plan=plan, tables=tables)
        return plan

    # ---- explicit prefixes and eviction ---------------------------------------------------

    def pin_prefix(
        self, token_ids: Sequence[int], extra_key: str | None = None
    ) -> PinnedPrefix | None:
        """Hold the cached blocks of every full block of ``token_ids`` until unpinned.

        Returns None, and changes nothing, unless all those blocks are cached (compute the prefix
        first, for example as a request's prompt, and pin it before that request frees it).
        """
        if not self.enable_prefix_caching:
            raise BlockPoolError("pin_prefix needs enable_prefix_caching=True.")
        _check_tokens(token_ids)
        num_full = len(token_ids) // self.block_size
        if num_full == 0:
            raise BlockPoolError(
                f"a pinned prefix needs at least one full block of {self.block_size} tokens, "
                f"got {len(token_ids)} tokens."
            )
        blocks, _ = self._match_prefix(token_ids, extra_key, num_blocks=num_full)
        if len(blocks) < num_full:
            return None
        for block in blocks:
            self.device.incref(block)
        pin = PinnedPrefix(
            pin_id=next(self._ids), block_ids=tuple(blocks), num_tokens=num_full * self.block_size
        )
        self._pins[pin.pin_id] = pin.block_ids
        return pin

    def unpin_prefix(self, pin_id: int) -> None:
        if pin_id not in self._pins:
            raise BlockPoolError(f"no pinned prefix with id {pin_id}.")
        self.device.release(self._pins.pop(pin_id))

    def evict_cached_blocks(self, num_blocks: int | None = None) -> int:
        """Evict up to ``num_blocks`` unheld cached blocks (all if None), least recently used
        first; returns how many were evicted."""
        return self.device.evict(num_blocks)

    # ---- statistics and checks ------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            block_size=self.block_size,
            device=_usage(self.device),
            host=_usage(self.host),
            num_filled_device_slots=self.device.num_filled_held,
            num_held_device_blocks=self.device.num_held,
            num_shared_device_blocks=self.device.num_shared,
            num_seqs=len(self._tables),
            num_pins=len(self._pins),
            num_swaps_in_flight=len(self._swaps),
            num_cow_copies=self.num_cow_copies,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_host_hit_tokens=self.prefix_tier_hit_tokens["host"],
            prefix_disk_hit_tokens=self.prefix_tier_hit_tokens["disk"],
            num_tier_offloads=self.tiers.num_offloads if self.tiers else 0,
            num_tier_spills=self.tiers.num_spills if self.tiers else 0,
        )

    def state(self) -> tuple[object, ...]:
        """A comparable snapshot of the whole pool (O(pool); for tests)."""
        tables = tuple(
            (sid, t.extra_key, tuple(t.block_ids), t.num_tokens, tuple(t.block_hashes),
             tuple(t.partial_token_ids), t.location)
            for sid, t in self._tables.items()
        )  # fmt: skip
        swaps = tuple((i, s.plan) for i, s in self._swaps.items())
        counters = (self.num_cow_copies, self.prefix_query_tokens, self.prefix_hit_tokens,
                    tuple(self.prefix_tier_hit_tokens.values()))  # fmt: skip
        tiers = self.tiers.state() if self.tiers else ()
        return (self.device.state(), self.host.state(), tables, tuple(self._pins.items()),
                swaps, counters, tiers, tuple(self._speculative.items()))  # fmt: skip

    def check_invariants(self) -> None:
        """Assert every invariant of the class docstring (O(pool); for tests)."""
        from asyncpaged.core.pool_invariants import check_block_pool

        check_block_pool(self, self._tables, self._pins, [s.plan for s in self._swaps.values()])
        if self.tiers is not None:
            self.tiers.check_invariants()
        assert self.shared_tails() == frozenset(
            sid
            for sid, t in self._tables.items()
            if t.location is Location.DEVICE
            and t.num_tokens % self.block_size
            and self.device.ref_cnt[t.block_ids[-1]] > 1
        ), "a shared partial last block outside the forked tables"
        bs = self.block_size
        for sid, tail in self._speculative.items():
            table = self._tables[sid]
            assert table.location is Location.DEVICE, f"{sid!r}: speculative tail off device"
            assert tail.start <= table.num_tokens, f"{sid!r}: speculative tail past the end"
            for i in range(tail.start // bs, table.num_tokens // bs):
                assert self.device.hash_of(table.block_ids[i]) is None, (
                    f"{sid!r}: a block holding speculative tokens is in the prefix cache"
                )
            if self.enable_prefix_caching:
                assert len(tail.known_tokens) == table.num_tokens - tail.known_start
                assert tail.known_start <= tail.start
                num_partial = table.num_tokens % bs
                if num_partial:
                    assert list(tail.known_tokens[-num_partial:]) == table.partial_token_ids

    # ---- internals ------------------------------------------------------------------------

    def _table(self, seq_id: SeqId) -> BlockTable:
        table = self._tables.get(seq_id)
        if table is None:
            raise BlockPoolError(f"unknown sequence {seq_id!r}.")
        return table

    def _device_table(self, seq_id: SeqId, action: str) -> BlockTable:
        table = self._table(seq_id)
        if table.location is not Location.DEVICE:
            raise BlockPoolError(
                f"cannot {action} sequence {seq_id!r}: it is {table.location.value}, not on device."
            )
        return table

    def _pool_of(self, table: BlockTable) -> PhysicalBlocks:
        return self.host if table.location.on_host else self.device

    def _swap_tables(
        self, seq_ids: Sequence[SeqId], direction: SwapDirection
    ) -> tuple[BlockTable, ...]:
        if not seq_ids:
            raise BlockPoolError("a swap needs at least one sequence.")
        if len(set(seq_ids)) != len(seq_ids):
            raise BlockPoolError(f"duplicate sequence ids in swap group {list(seq_ids)!r}.")
        want = Location.DEVICE if direction is SwapDirection.OUT else Location.HOST
        tables = tuple(self._table(sid) for sid in seq_ids)
        for table in tables:
            if table.location is not want:
                raise BlockPoolError(
                    f"cannot swap {direction.value} sequence {table.seq_id!r}: it is "
                    f"{table.location.value}, not {want.value}."
                )
            self._check_verified(table.seq_id, "swap out")
        return tables

    def _check_verified(self, seq_id: SeqId, action: str) -> None:
        if seq_id in self._speculative:
            raise BlockPoolError(
                f"cannot {action} sequence {seq_id!r}: it holds speculative tokens not yet "
                "verified (truncate it first)."
            )

    def _speculative_tail(
        self, table: BlockTable, token_ids: Sequence[int], num_speculative: int
    ) -> _SpeculativeTail:
        """The record of an append's speculative tokens, taken before its slots are written."""
        start = table.num_tokens + len(token_ids) - num_speculative
        if not self.enable_prefix_caching:
            return _SpeculativeTail(start=start, known_start=start, known_tokens=())
        known_start = start - start % self.block_size
        partial_start = table.num_tokens - len(table.partial_token_ids)
        known = (*table.partial_token_ids, *token_ids)[known_start - partial_start :]
        return _SpeculativeTail(start=start, known_start=known_start, known_tokens=known)

    def _kept_partial_tokens(
        self, table: BlockTable, tail: _SpeculativeTail | None, num_tokens: int
    ) -> list[int]:
        """The tokens of the last block after truncating to ``num_tokens`` (prefix caching);
        raises unless the pool knows them."""
        num_partial = num_tokens % self.block_size
        if not self.enable_prefix_caching or not num_partial:
            return []
        if tail is not None:
            known_start, known = tail.known_start, tail.known_tokens
        else:
            known = tuple(table.partial_token_ids)
            known_start = table.num_tokens - len(known)
        block_start = num_tokens - num_partial
        if block_start < known_start:
            raise BlockPoolError(
                f"cannot truncate sequence {table.seq_id!r} to {num_tokens} tokens: the tokens "
                f"of that block are no longer known (truncate within its last block, its "
                f"speculative tail, or to a multiple of {self.block_size})."
            )
        return list(known[block_start - known_start : num_tokens - known_start])

    def _truncate_last_block(self, table: BlockTable, num_tokens: int) -> None:
        """The last block after truncating into it: an exclusive one forgets the dropped slots;
        a shared one keeps them for its other holders and is copied on this table's next append
        (it was never registered: :meth:`_kept_partial_tokens` only admits blocks that are
        partial or hold speculative tokens)."""
        block = table.block_ids[-1]
        assert self.device.hash_of(block) is None, f"truncated into cached block {block}"
        if self.device.ref_cnt[block] > 1:
            self._forked.add(table.seq_id)
            return
        self._set_filled(block, num_tokens % self.block_size)

    def _set_filled(self, block: int, num_slots: int) -> None:
        """Make an exclusively held block's written-slot count ``num_slots``: the slots past it
        are dead (truncated away, or a sibling's that freed the block since)."""
        self.device.fill(block, num_slots - self.device.num_filled[block])

    def _num_tokens_after_allocate(
        self, token_ids: Sequence[int], num_hit_blocks: int, max_new_tokens: int | None
    ) -> int:
        if max_new_tokens is not None and max_new_tokens < 1:
            raise BlockPoolError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
        num_cached = num_hit_blocks * self.block_size
        if max_new_tokens is None:
            return len(token_ids)
        return min(len(token_ids), num_cached + max_new_tokens)

    def _blocks_to_append(self, table: BlockTable, num_tokens: int) -> int:
        bs = self.block_size
        need = -(-(table.num_tokens + num_tokens) // bs) - len(table.block_ids)
        if table.num_tokens % bs and self.device.ref_cnt[table.block_ids[-1]] > 1:
            need += 1
        return need

    def _match_prefix(
        self, token_ids: Sequence[int], extra_key: str | None, num_blocks: int | None = None
    ) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks (and their hashes) for the leading full blocks of ``token_ids``.

        By default the last token is excluded: a prompt needs the logits of its last token.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        if num_blocks is None:
            num_blocks = (len(token_ids) - 1) // bs
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        parent = ROOT_HASH
        for i in range(num_blocks):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra_key)
            block = self.device.lookup(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def _match_tiers(
        self, token_ids: Sequence[int], extra_key: str | None, device_hashes: list[BlockHash]
    ) -> list[BlockHash]:
        """Hashes of the full blocks after the device hits that a lower tier holds, up to the
        first that none does (or that is on the device); never the prompt's last token."""
        tiers = self.tiers
        if tiers is None:
            return []
        bs = self.block_size
        found: list[BlockHash] = []
        parent = device_hashes[-1] if device_hashes else ROOT_HASH
        for i in range(len(device_hashes), (len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra_key)
            if self.device.lookup(parent) is not None or tiers.lookup(parent) is None:
                break
            found.append(parent)
        return found

    def _restore(self, table: BlockTable, hashes: list[BlockHash]) -> None:
        """Give ``table`` a new, registered device block per tier hit and record each copy.
        Taking a block may evict (offload) another: the entries being restored are protected
        from the tiers' own evictions meanwhile."""
        tiers, device, bs = self.tiers, self.device, self.block_size
        assert tiers is not None
        for block_hash in hashes:
            tiers.protect(block_hash)
        for block_hash in hashes:
            block = device.take(after=table.block_ids[-1] if table.block_ids else None)
            device.fill(block, bs)
            registered = device.register(block, block_hash)
            assert registered, "a restored block's hash is already on the device"
            self.prefix_tier_hit_tokens[tiers.restore(block_hash, block)] += bs
            table.block_ids.append(block)
            table.block_hashes.append(block_hash)

    def persist_tiers(self) -> tuple[TierOp, ...]:
        """Copy every cached device block (least recently used first, pinned ones last) and
        every host-tier entry down to the disk tier; the device cache is left as it is. For a
        shutdown with nothing running: returns the ops to run."""
        tiers = self.tiers
        if tiers is None:
            return ()
        pinned = [b for blocks in self._pins.values() for b in blocks]
        for block in (*self.device.evictable_blocks(), *dict.fromkeys(pinned)):
            block_hash = self.device.hash_of(block)
            assert block_hash is not None, f"cached block {block} has no hash"
            tiers.offload(block, block_hash)
        tiers.persist()
        return tiers.drain_ops()

    def begin_tier_txn(self, failed_spills: Iterable[BlockHash] = ()) -> None:
        """Start a transaction for the tiers (see :meth:`TierIndex.begin`)."""
        if self.tiers is not None:
            self.tiers.begin(failed_spills)

    def drain_tier_ops(self) -> tuple[TierOp, ...]:
        """The tier copies decided since the last call, in order (run before the next step)."""
        return self.tiers.drain_ops() if self.tiers is not None else ()

    def append_token(self, seq_id: SeqId, token: int) -> int | None:
        """The decode fast path of :meth:`append`: the slot of one token appended into the
        sequence's exclusive partial last block (no allocation, no copy). None, with nothing
        changed, when that does not apply (use :meth:`append`)."""
        table = self._tables.get(seq_id)
        if table is None or table.location is not Location.DEVICE or seq_id in self._speculative:
            return None
        bs, device = self.block_size, self.device
        offset = table.num_tokens % bs
        if not offset:
            return None
        block = table.block_ids[-1]
        if device.ref_cnt[block] != 1:
            return None
        if device.num_filled[block] != offset:  # dead slots past a truncation
            self._set_filled(block, offset)
        device.fill(block, 1)
        table.num_tokens += 1
        if self.enable_prefix_caching:
            table.partial_token_ids.append(token)
            if offset + 1 == bs:
                parent = table.block_hashes[-1] if table.block_hashes else ROOT_HASH
                block_hash = hash_block(parent, table.partial_token_ids, table.extra_key)
                table.block_hashes.append(block_hash)
                table.partial_token_ids.clear()
                device.register(block, block_hash)
        return block * bs + offset

    def _write(
        self, table: BlockTable, token_ids: Sequence[int], num_verified: int | None = None
    ) -> tuple[int, ...]:
        """Reserve slots for ``token_ids`` at the end of ``table`` (capacity already checked).

        A block that fills up is hashed and registered in the prefix cache at once: the step that
        writes its last token writes the K/V of every token before any attention reads the cache.
        Tokens from ``num_verified`` on are speculative: a block holding one is hashed into the
        table but not registered (:meth:`truncate` registers it once verified).
        """
        cache_end = table.num_tokens + (len(token_ids) if num_verified is None else num_verified)
        bs = self.block_size
        device = self.device
        slots: list[int] = []
        pos, end, i = table.num_tokens, table.num_tokens + len(token_ids), 0
        while pos < end:
            offset = pos % bs
            if offset == 0:
                prev = table.block_ids[-1] if table.block_ids else None
                table.block_ids.append(device.take(after=prev))
            block = table.block_ids[-1]
            if device.num_filled[block] != offset:  # dead slots past a truncation
                self._set_filled(block, offset)
            n = min(bs - offset, end - pos)
            slots.extend(range(block * bs + offset, block * bs + offset + n))
            device.fill(block, n)
            if self.enable_prefix_caching:
                table.partial_token_ids.extend(token_ids[i : i + n])
                if offset + n == bs:
                    parent = table.block_hashes[-1] if table.block_hashes else ROOT_HASH
                    block_hash = hash_block(parent, table.partial_token_ids, table.extra_key)
                    table.block_hashes.append(block_hash)
                    table.partial_token_ids.clear()
                    if pos + n <= cache_end:
                        device.register(block, block_hash)
            pos += n
            i += n
        table.num_tokens = end
        return tuple(slots)


def _check_tokens(token_ids: Sequence[int]) -> None:
    if len(token_ids) == 0:
        raise BlockPoolError("token_ids must not be empty.")


def _distinct_blocks(tables: Iterable[BlockTable]) -> list[int]:
    return list(dict.fromkeys(b for t in tables for b in t.block_ids))


def _usage(pool: PhysicalBlocks) -> PoolUsage:
    in_flight = len(pool.in_flight)
    return PoolUsage(
        total=pool.num_blocks,
        free=pool.num_free,
        used=pool.num_held - in_flight,
        cached=pool.num_evictable,
        in_flight=in_flight,
    )
