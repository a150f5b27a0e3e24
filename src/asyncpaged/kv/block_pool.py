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

The :class:`BlockPool` owns the block tables and both pools of physical blocks
(kv/physical_blocks.py), and writes the tables itself: allocation, appends with copy-on-write,
forks, frees, truncation, and moving tables between the pools for a swap. Three pieces with state
of their own are classes it holds: the :class:`~asyncpaged.kv.prefix_cache.PrefixCache` (hash
chains, matching, the KV tiers, pins), :class:`~asyncpaged.kv.swaps_in_flight.SwapsInFlight`
(each started swap until it completes) and
:class:`~asyncpaged.kv.speculative_tails.SpeculativeTails` (proposals not yet verified).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from asyncpaged.errors import BlockPoolError
from asyncpaged.kv.block_table import (
    PLACEHOLDER_TOKEN,
    AppendResult,
    BlockTable,
    Location,
    PinnedPrefix,
    PoolStatistics,
    PrefixHit,
    SeqAllocation,
    SeqId,
    SwapDirection,
    SwapPlan,
)
from asyncpaged.kv.physical_blocks import PhysicalBlocks
from asyncpaged.kv.prefix_cache import HashChain, PrefixCache
from asyncpaged.kv.prefix_hash import ROOT_HASH, BlockHash
from asyncpaged.kv.speculative_tails import SpeculativeTails
from asyncpaged.kv.swaps_in_flight import SwapsInFlight
from asyncpaged.kv.tiers import TierIndex, TierOp

__all__ = ["BlockPool"]


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
    * A placeholder (:data:`PLACEHOLDER_TOKEN`, async scheduling) is a table's last token, appended
      alone; a block it fills is neither hashed nor registered until :meth:`set_placeholder`
      gives it its value. Until then the sequence can neither grow, fork, truncate nor swap.
    * With ``tiers`` (kv/tiers.py), every cached block evicted from the device is handed to
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
        """``tiers``: the host and disk KV tiers below the prefix cache (kv/tiers.py):
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
        self._forked: set[SeqId] = set()
        self._prefix_cache = PrefixCache(self.device, tiers, enabled=enable_prefix_caching)
        self._swaps = SwapsInFlight(self.device, self.host)
        self._speculative = SpeculativeTails(block_size, caching=enable_prefix_caching)
        self._ids = itertools.count()  # swap ids and pin ids, one sequence
        self.num_cow_copies = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_tier_hit_tokens = {"host": 0, "disk": 0}
        self.tiers = self._prefix_cache.tiers

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
        return self._prefix_cache.pins

    def shared_tails(self) -> frozenset[SeqId]:
        """Device sequences whose partial last block is shared: their next append copies it."""
        if not self._forked:  # the common case: no sequence was ever forked
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
        tables, ref_cnt = self._tables, self.device.ref_cnt
        if len(seq_ids) == 1:  # the common case: a block of one table is exclusive at refcount 1
            table = tables.get(seq_ids[0])
            if table is None or table.location is not Location.DEVICE:
                return None
            exclusive = operator.countOf(map(ref_cnt.__getitem__, table.block_ids), 1)
            return exclusive, len(table.block_ids)
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

    def block_ids_of(self, seq_ids: Sequence[SeqId]) -> tuple[tuple[int, ...], ...]:
        """:meth:`block_ids` of each sequence (a step's appended ones: one pass)."""
        tables = self._tables
        try:
            return tuple([tuple(tables[seq_id].block_ids) for seq_id in seq_ids])
        except KeyError as exc:
            raise BlockPoolError(f"unknown sequence {exc.args[0]!r}.") from None

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._table(seq_id).num_tokens

    def location(self, seq_id: SeqId) -> Location:
        return self._table(seq_id).location

    def lookup_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> PrefixHit:
        """The cached full blocks that a prompt ``token_ids`` would reuse (never its last token)."""
        return self._prefix_cache.lookup(token_ids, extra_key)

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
        return self._plan_allocation(token_ids, max_new_tokens, extra_key, read_cache).num_blocks

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
        return self._num_blocks_to_append(self._device_table(seq_id, "append to"), num_tokens)

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
        return self._swaps.num_blocks_coming()

    def can_append(self, seq_id: SeqId, num_tokens: int = 1) -> bool:
        return self.num_blocks_to_append(seq_id, num_tokens) <= self.device.num_allocatable

    def num_blocks_to_swap(self, seq_ids: Sequence[SeqId], direction: SwapDirection) -> int:
        """Blocks a swap of this group takes in the destination pool (shared blocks once)."""
        return len(_distinct_blocks(self._swap_group(seq_ids, direction)))

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        return self.num_blocks_to_swap(seq_ids, SwapDirection.OUT) <= self.host.num_allocatable

    def has_speculative_tokens(self, seq_id: SeqId) -> bool:
        """Whether the sequence holds proposals not yet verified (see :meth:`truncate`)."""
        self._table(seq_id)
        return seq_id in self._speculative

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
        plan = self._plan_allocation(token_ids, max_new_tokens, extra_key, read_cache)
        if plan.num_blocks > self.device.num_allocatable:
            return None
        device, num_cached = self.device, plan.num_cached_tokens
        if self.enable_prefix_caching:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += num_cached
        for block in plan.hit:
            device.incref(block)
        table = BlockTable(seq_id=seq_id, extra_key=extra_key, block_ids=plan.hit)
        table.block_hashes = plan.hashes
        if plan.restored:
            for tier in self._prefix_cache.restore(table, plan.restored):
                self.prefix_tier_hit_tokens[tier] += self.block_size
        table.num_tokens = num_cached
        new_tokens = token_ids[num_cached : plan.num_tokens]
        slots = self._write_slots(table, new_tokens, chain=plan.chain)
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
        if len(token_ids) > 1 and PLACEHOLDER_TOKEN in token_ids:
            raise BlockPoolError("a placeholder is appended alone.")
        self._check_settled(table, "append to")
        self._speculative.check_num_speculative(num_speculative_tokens, len(token_ids))
        self._speculative.check_verified(seq_id, "append to")
        need = self._num_blocks_to_append(table, len(token_ids))
        if need > self.device.num_allocatable:
            return None
        cow = self._copy_on_write(table)
        self.num_cow_copies += len(cow)
        if num_speculative_tokens:
            self._speculative.open(table, token_ids, num_speculative_tokens)
        num_verified = len(token_ids) - num_speculative_tokens
        slots = self._write_slots(table, token_ids, num_verified)
        return AppendResult(slot_mapping=slots, copy_on_write=cow)

    def append_token(self, seq_id: SeqId, token: int) -> int | None:
        """The decode fast path of :meth:`append`: the slot of one token appended into the
        sequence's exclusive partial last block (no allocation, no copy). None, with nothing
        changed, when that does not apply (use :meth:`append`)."""
        table = self._tables.get(seq_id)
        if table is None or table.location is not Location.DEVICE or seq_id in self._speculative:
            return None
        bs, device = self.block_size, self.device  # inline, not through _write_slots: per token
        offset = table.num_tokens % bs
        if not offset:
            return None
        block = table.block_ids[-1]
        if device.ref_cnt[block] != 1:
            return None
        partial = table.partial_token_ids
        if self.enable_prefix_caching and partial[-1] == PLACEHOLDER_TOKEN:  # (never empty here)
            self._check_settled(table, "append to")  # raises before anything changes
        if device.num_filled[block] != offset:  # dead slots past a truncation
            device.set_filled(block, offset)
        device.fill(block, 1)
        table.num_tokens += 1
        if self.enable_prefix_caching:
            partial.append(token)
            if offset + 1 == bs and token != PLACEHOLDER_TOKEN:
                device.register(block, PrefixCache.seal_full_block(table))
        return block * bs + offset

    def set_placeholder(self, seq_id: SeqId, token: int) -> None:
        """The value of the :data:`PLACEHOLDER_TOKEN` last appended to a device sequence (async
        scheduling: the step that sampled it returned after the next one was planned). A
        block it filled is hashed and registered in the prefix cache now."""
        table = self._tables.get(seq_id)  # (_device_table, inline: once per sequence per step)
        if table is None or table.location is not Location.DEVICE:
            table = self._device_table(seq_id, "set a placeholder of")  # raises
        if token < 0:
            raise BlockPoolError(f"token ids must be >= 0, got {token}.")
        if not self.enable_prefix_caching:
            return  # the pool keeps no tokens: nothing changes
        partial = table.partial_token_ids
        if not partial or partial[-1] != PLACEHOLDER_TOKEN:
            raise BlockPoolError(f"sequence {table.seq_id!r} has no placeholder to set.")
        partial[-1] = token
        if len(partial) == self.block_size:
            self.device.register(table.block_ids[-1], PrefixCache.seal_full_block(table))

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give ``child_id`` the parent's table, sharing every block (never allocates)."""
        parent = self._device_table(parent_id, "fork")
        self._speculative.check_verified(parent_id, "fork")
        self._check_settled(parent, "fork")
        if child_id in self._tables:
            raise BlockPoolError(f"cannot fork into {child_id!r}: that sequence already exists.")
        for block in parent.block_ids:
            self.device.incref(block)
        self._tables[child_id] = parent.copy(child_id)
        self._forked.update((parent.seq_id, child_id))

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence and its references, tail first, wherever its blocks are.

        Blocks of a swap in flight stay held by the swap until :meth:`complete_swap`.
        """
        table = self._table(seq_id)
        del self._tables[seq_id]
        self._forked.discard(seq_id)
        self._speculative.close(seq_id)
        (self.host if table.location.on_host else self.device).release(table.block_ids)

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
        self._check_settled(table, "truncate")
        if not 1 <= num_tokens <= table.num_tokens:
            raise BlockPoolError(
                f"cannot truncate sequence {table.seq_id!r} to {num_tokens} tokens: it has "
                f"{table.num_tokens} (keep at least 1)."
            )
        tail = self._speculative.get(seq_id)
        bs, device = self.block_size, self.device
        partial = self._speculative.kept_partial_tokens(table, num_tokens)
        keep = -(-num_tokens // bs)
        dropped = tuple(table.block_ids[keep:])
        del table.block_ids[keep:]
        device.release(dropped)
        if num_tokens % bs:
            # The last block: an exclusive one forgets the dropped slots; a shared one keeps
            # them for its other holders and is copied on this table's next append (it was
            # never registered: kept_partial_tokens only admits blocks that are partial or
            # hold speculative tokens).
            block = table.block_ids[-1]
            assert device.hash_of(block) is None, f"truncated into cached block {block}"
            if device.ref_cnt[block] > 1:
                self._forked.add(seq_id)
            else:
                device.set_filled(block, num_tokens % bs)
        table.num_tokens = num_tokens
        if self.enable_prefix_caching:
            del table.block_hashes[num_tokens // bs :]
            table.partial_token_ids = partial
            if tail is not None:  # the kept proposals are verified: cache their full blocks
                self._prefix_cache.register_full_blocks(table, tail.start // bs)
        self._speculative.close(seq_id)
        return dropped

    # ---- swap -----------------------------------------------------------------------------

    def swap_out(self, seq_ids: Sequence[SeqId]) -> SwapPlan | None:
        """Map every device block of a sequence group to a new host block, all or nothing.

        Blocks shared inside the group get one host block, so the sharing survives. The group
        moves to SWAPPING_OUT; both ends of each copy stay in flight until :meth:`complete_swap`.
        Returns None, and changes nothing, when the host pool is short.
        """
        return self._start_swap(seq_ids, SwapDirection.OUT)

    def swap_in(self, seq_ids: Sequence[SeqId]) -> SwapPlan | None:
        """The reverse of :meth:`swap_out`, for a group on the host; None if the device is short."""
        return self._start_swap(seq_ids, SwapDirection.IN)

    def num_blocks_freed_by_swap(self, swap_id: int) -> int:
        """Source blocks that completing this swap would release (their only holder is it)."""
        return self._swaps.num_blocks_freed(swap_id)

    def complete_swap(self, swap_id: int) -> None:
        """The copies of a swap are done: release the in-flight holds, finish the moves.

        A table freed while the copy ran is skipped; a table swapped in registers its full
        blocks in the prefix cache again."""
        swap = self._swaps.pop(swap_id)
        src, dst = self._swaps.pools(swap.plan.direction)
        out = swap.plan.direction is SwapDirection.OUT
        src.release_in_flight(s for s, _ in swap.plan.block_mapping)
        dst.release_in_flight(d for _, d in swap.plan.block_mapping)
        for table in swap.tables:
            if self._tables.get(table.seq_id) is not table:
                continue  # freed while the copy ran
            table.location = Location.HOST if out else Location.DEVICE
            if not out and self.enable_prefix_caching:
                self._prefix_cache.register_full_blocks(table)

    # ---- explicit prefixes, eviction and the KV tiers -------------------------------------

    def pin_prefix(
        self, token_ids: Sequence[int], extra_key: str | None = None
    ) -> PinnedPrefix | None:
        """Hold the cached blocks of every full block of ``token_ids`` until unpinned.

        Returns None, and changes nothing, unless all those blocks are cached (compute the prefix
        first, for example as a request's prompt, and pin it before that request frees it).
        """
        return self._prefix_cache.pin(token_ids, extra_key, self._ids)

    def unpin_prefix(self, pin_id: int) -> None:
        self._prefix_cache.unpin(pin_id)

    def evict_cached_blocks(self, num_blocks: int | None = None) -> int:
        """Evict up to ``num_blocks`` unheld cached blocks (all if None), least recently used
        first; returns how many were evicted."""
        return self.device.evict(num_blocks)

    def persist_tiers(self) -> tuple[TierOp, ...]:
        """Copy every cached device block (least recently used first, pinned ones last) and
        every host-tier entry down to the disk tier; the device cache is left as it is. For a
        shutdown with nothing running: returns the ops to run."""
        return self._prefix_cache.persist()

    def begin_tier_txn(self, failed_spills: Iterable[BlockHash] = ()) -> None:
        """Start a transaction for the tiers (see :meth:`TierIndex.begin`)."""
        if self.tiers is not None:
            self.tiers.begin(failed_spills)

    def drain_tier_ops(self) -> tuple[TierOp, ...]:
        """The tier copies decided since the last call, in order (run before the next step)."""
        return self.tiers.drain_ops() if self.tiers is not None else ()

    # ---- statistics and checks ------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        tiers, device = self.tiers, self.device
        return PoolStatistics(
            block_size=self.block_size,
            device=device.usage(),
            host=self.host.usage(),
            num_filled_device_slots=device.num_filled_held,
            num_held_device_blocks=device.num_held,
            num_shared_device_blocks=device.num_shared,
            num_seqs=len(self._tables),
            num_pins=len(self._prefix_cache.pins),
            num_swaps_in_flight=len(self._swaps),
            num_cow_copies=self.num_cow_copies,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_host_hit_tokens=self.prefix_tier_hit_tokens["host"],
            prefix_disk_hit_tokens=self.prefix_tier_hit_tokens["disk"],
            num_tier_offloads=tiers.num_offloads if tiers else 0,
            num_tier_spills=tiers.num_spills if tiers else 0,
        )

    def state(self) -> tuple[object, ...]:
        """A comparable snapshot of the whole pool (O(pool); for tests)."""
        table_states = tuple(
            (sid, t.extra_key, tuple(t.block_ids), t.num_tokens, tuple(t.block_hashes),
             tuple(t.partial_token_ids), t.location)
            for sid, t in self._tables.items()
        )  # fmt: skip
        counters = (self.num_cow_copies, self.prefix_query_tokens, self.prefix_hit_tokens,
                    tuple(self.prefix_tier_hit_tokens.values()))  # fmt: skip
        tiers = self.tiers.state() if self.tiers else ()
        return (self.device.state(), self.host.state(), table_states,
                tuple(self._prefix_cache.pins.items()), self._swaps.state(), counters, tiers,
                tuple(self._speculative.items()))  # fmt: skip

    def check_invariants(self) -> None:
        """Assert every invariant of the class docstring (O(pool); for tests)."""
        self._check_holders()
        if self.tiers is not None:
            self.tiers.check_invariants()
        bs, ref_cnt = self.block_size, self.device.ref_cnt
        assert self.shared_tails() == frozenset(
            sid
            for sid, t in self._tables.items()
            if t.location is Location.DEVICE and t.num_tokens % bs and ref_cnt[t.block_ids[-1]] > 1
        ), "a shared partial last block outside the forked tables"
        self._speculative.check_invariants(self.device, self._tables)

    # ---- private: checks ------------------------------------------------------------------

    def _table(self, seq_id: SeqId) -> BlockTable:
        """The sequence's table; raises for an unknown sequence."""
        table = self._tables.get(seq_id)
        if table is None:
            raise BlockPoolError(f"unknown sequence {seq_id!r}.")
        return table

    def _device_table(self, seq_id: SeqId, action: str) -> BlockTable:
        """The sequence's table; raises unless it is on the device (``action``: what the call
        would do to the sequence, for the message)."""
        table = self._table(seq_id)
        if table.location is not Location.DEVICE:
            raise BlockPoolError(
                f"cannot {action} sequence {seq_id!r}: it is {table.location.value}, not on device."
            )
        return table

    def _check_settled(self, table: BlockTable, action: str) -> None:
        """A sequence waiting for its placeholder's value cannot change otherwise (the pool
        knows a placeholder only with prefix caching)."""
        if self.enable_prefix_caching and table.partial_token_ids[-1:] == [PLACEHOLDER_TOKEN]:
            raise BlockPoolError(
                f"cannot {action} sequence {table.seq_id!r}: its last token is late "
                "(set_placeholder first)."
            )

    # ---- private: counting ----------------------------------------------------------------

    def _plan_allocation(
        self,
        token_ids: Sequence[int],
        max_new_tokens: int | None,
        extra_key: str | None,
        read_cache: bool,
    ) -> AllocationPlan:
        """The :class:`AllocationPlan` of a prompt against the cache and tiers as they are now
        (``read_cache=False``: no hit); raises for ``max_new_tokens < 1``. With prefix caching
        the prompt's block hashes come from the memo that hashes each prompt tuple once."""
        bs, device, cache = self.block_size, self.device, self._prefix_cache
        chain = cache.chain_of(token_ids, extra_key)
        hit, hashes = cache.match(token_ids, extra_key, None if read_cache else 0, chain)
        restored = cache.match_tiers(token_ids, extra_key, hashes, chain) if read_cache else []
        num_hit = len(hit) + len(restored)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise BlockPoolError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
        num_cached = num_hit * bs
        if max_new_tokens is None:
            num_tokens = len(token_ids)
        else:
            num_tokens = min(len(token_ids), num_cached + max_new_tokens)
        num_new_blocks = -(-num_tokens // bs) - len(hit)
        need = num_new_blocks + sum(1 for b in hit if device.ref_cnt[b] == 0)
        return AllocationPlan(
            hit=hit,
            hashes=hashes,
            restored=restored,
            num_cached_tokens=num_cached,
            num_tokens=num_tokens,
            num_blocks=need,
            chain=chain,
        )

    def _num_blocks_to_append(self, table: BlockTable, num_tokens: int) -> int:
        """Device blocks that appending ``num_tokens`` tokens to the device ``table`` takes, a
        copy of its shared partial last block included."""
        bs = self.block_size
        need = -(-(table.num_tokens + num_tokens) // bs) - len(table.block_ids)
        if table.num_tokens % bs and self.device.ref_cnt[table.block_ids[-1]] > 1:
            need += 1
        return need

    # ---- private: writing tables ----------------------------------------------------------

    def _copy_on_write(self, table: BlockTable) -> tuple[tuple[int, int], ...]:
        """Move ``table`` off a partial last block that other tables hold, onto a new block;
        returns the ``(src, dst)`` copy the executor must run before writing, or ``()`` when
        the last block is full or exclusive (one block of capacity already checked)."""
        bs, device = self.block_size, self.device
        if not (table.num_tokens % bs and device.ref_cnt[table.block_ids[-1]] > 1):
            return ()
        src = table.block_ids[-1]
        dst = device.take(after=table.block_ids[-2] if len(table.block_ids) > 1 else None)
        # this table's slots only: after a truncation the source may hold more (a sibling's)
        device.fill(dst, table.num_tokens % bs)
        device.release((src,))
        table.block_ids[-1] = dst
        return ((src, dst),)

    def _write_slots(
        self,
        table: BlockTable,
        token_ids: Sequence[int],
        num_verified: int | None = None,
        *,
        chain: HashChain | None = None,
    ) -> tuple[int, ...]:
        """Reserve slots for ``token_ids`` at the end of ``table`` (capacity already checked).

        A block that fills up is hashed and registered in the prefix cache at once: the step
        that writes its last token writes the K/V of every token before any attention reads
        the cache; one filled by a :data:`PLACEHOLDER_TOKEN` waits for its value
        (:meth:`set_placeholder`). Tokens from ``num_verified`` on are speculative: a block
        holding one is hashed into the table but not registered (:meth:`truncate` registers it
        once verified). ``chain``: the hashes of the table's prompt when ``token_ids`` are its
        tokens (read, not computed, for the blocks they fill).
        """
        cache_end = table.num_tokens + (len(token_ids) if num_verified is None else num_verified)
        bs, device, caching = self.block_size, self.device, self.enable_prefix_caching
        slots: list[int] = []
        pos, end, i = table.num_tokens, table.num_tokens + len(token_ids), 0
        while pos < end:
            offset = pos % bs
            if offset == 0:
                prev = table.block_ids[-1] if table.block_ids else None
                table.block_ids.append(device.take(after=prev))
            block = table.block_ids[-1]
            if device.num_filled[block] != offset:  # dead slots past a truncation
                device.set_filled(block, offset)
            n = min(bs - offset, end - pos)
            slots.extend(range(block * bs + offset, block * bs + offset + n))
            device.fill(block, n)
            if caching:
                table.partial_token_ids.extend(token_ids[i : i + n])
                if offset + n == bs and table.partial_token_ids[-1] != PLACEHOLDER_TOKEN:
                    block_hash = PrefixCache.seal_full_block(table, chain)
                    if pos + n <= cache_end:
                        device.register(block, block_hash)
            pos += n
            i += n
        table.num_tokens = end
        return tuple(slots)

    # ---- private: swaps -------------------------------------------------------------------

    def _swap_group(
        self, seq_ids: Sequence[SeqId], direction: SwapDirection
    ) -> tuple[BlockTable, ...]:
        """The tables of a group that can swap in ``direction``; raises for an empty group, an
        unknown or repeated sequence, one in the wrong place or one holding speculative
        tokens."""
        if not seq_ids:
            raise BlockPoolError("a swap needs at least one sequence.")
        if len(set(seq_ids)) != len(seq_ids):
            raise BlockPoolError(f"duplicate sequence ids in swap group {list(seq_ids)!r}.")
        want = Location.DEVICE if direction is SwapDirection.OUT else Location.HOST
        group = tuple(self._table(sid) for sid in seq_ids)
        for table in group:
            if table.location is not want:
                raise BlockPoolError(
                    f"cannot swap {direction.value} sequence {table.seq_id!r}: it is "
                    f"{table.location.value}, not {want.value}."
                )
            self._speculative.check_verified(table.seq_id, "swap out")
        return group

    def _start_swap(self, seq_ids: Sequence[SeqId], direction: SwapDirection) -> SwapPlan | None:
        """Start the swap of a group in ``direction``: checked (and no placeholder), every block
        mapped to a new block of the other pool (a block shared inside the group once), both
        ends held in flight, the tables moved to the swapping location, and the swap recorded;
        returns its plan, or None, changing nothing, when the destination pool is short."""
        group = self._swap_group(seq_ids, direction)
        for table in group:
            self._check_settled(table, "swap")
        src, dst = self._swaps.pools(direction)
        blocks = _distinct_blocks(group)
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
        for table in group:
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
        self._swaps.add(plan, group)
        return plan

    # ---- private: the invariant check -----------------------------------------------------

    def _check_holders(self) -> None:
        """Assert that each block's reference count is its holders (tables, pins, swaps in
        flight), that in-flight holds match the swaps, and each table's shape and hashes."""
        device, host = self.device, self.host
        device_refs = [0] * device.num_blocks
        host_refs = [0] * host.num_blocks
        in_flight_dev = dict.fromkeys(device.in_flight, 0)
        in_flight_host = dict.fromkeys(host.in_flight, 0)
        swapping: set[SeqId] = set()
        for swap in self._swaps:
            out = swap.plan.direction is SwapDirection.OUT
            src, dst = (device_refs, host_refs) if out else (host_refs, device_refs)
            src_count, dst_count = (
                (in_flight_dev, in_flight_host) if out else (in_flight_host, in_flight_dev)
            )
            for s, d in swap.plan.block_mapping:
                src[s] += 1
                dst[d] += 1
                src_count[s] += 1
                dst_count[d] += 1
            swapping.update(swap.plan.seq_ids)
        for block_ids in self._prefix_cache.pins.values():
            for b in block_ids:
                device_refs[b] += 1
        for seq_id, table in self._tables.items():
            assert table.seq_id == seq_id
            assert len(table.block_ids) == -(-table.num_tokens // self.block_size), (
                f"{seq_id!r}: table length"
            )
            assert len(set(table.block_ids)) == len(table.block_ids), f"{seq_id!r}: repeated block"
            if table.location in (Location.SWAPPING_IN, Location.SWAPPING_OUT):
                assert seq_id in swapping, f"{seq_id!r} is {table.location.value} without a swap"
            refs = host_refs if table.location.on_host else device_refs
            for b in table.block_ids:
                refs[b] += 1
            self._check_hashes(table)
        device.check_invariants(device_refs)
        host.check_invariants(host_refs)
        assert in_flight_dev == device.in_flight, "device in-flight holds differ from swaps"
        assert in_flight_host == host.in_flight, "host in-flight holds differ from swaps"

    def _check_hashes(self, table: BlockTable) -> None:
        """Assert a table's hash chain and partial tokens (none without prefix caching)."""
        bs = self.block_size
        if not self.enable_prefix_caching:
            assert not table.block_hashes
            assert not table.partial_token_ids
            return
        partial = table.partial_token_ids
        # a block filled by a placeholder stays partial (unhashed) until the token's value is set
        deferred = len(partial) == bs and partial[-1] == PLACEHOLDER_TOKEN
        assert PLACEHOLDER_TOKEN not in partial[:-1], (
            f"{table.seq_id!r}: a placeholder before the last"
        )
        full = table.num_tokens // bs - deferred
        assert len(table.block_hashes) == full, f"{table.seq_id!r}: hash count"
        assert len(partial) == (bs if deferred else table.num_tokens % bs)
        if table.location is Location.DEVICE:
            for block, block_hash in zip(table.block_ids, table.block_hashes, strict=False):
                registered = self.device.hash_of(block)
                assert registered is None or registered == block_hash, (
                    "block registered under a wrong hash"
                )
        assert ROOT_HASH not in table.block_hashes


def _check_tokens(token_ids: Sequence[int]) -> None:
    """A call's token list is not empty."""
    if len(token_ids) == 0:
        raise BlockPoolError("token_ids must not be empty.")


def _distinct_blocks(tables: Iterable[BlockTable]) -> list[int]:
    """The blocks the tables hold, each once, in first-seen order."""
    return list(dict.fromkeys(b for t in tables for b in t.block_ids))
