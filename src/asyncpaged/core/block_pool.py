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

This module owns the :class:`BlockPool`: its tables, pins, swaps in flight and speculative
tails, and its statistics. Its methods check and delegate to functions of the pool or its
pieces, each passed explicitly: core/block_pool_checks.py (the checks before a change: the
sequence's table and where it is, the tokens, a late token; a new pool's sizes),
core/block_pool_counts.py (counting queries: allocations, appends, releases, shared tails),
core/block_pool_prefix.py (the hash chain, prefix cache and KV tier matching, tier restores and
persistence, pins), core/block_pool_write.py (a new or forked table, slots, copy-on-write, a
late token's value), core/block_pool_swap.py (starting, tracking and completing swaps),
core/block_pool_speculative.py (speculative tails, truncation) and core/block_pool_report.py
(statistics, the snapshot and the invariant check). The one-token append stays inline.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from asyncpaged.core import block_pool_counts as counts
from asyncpaged.core import block_pool_prefix as prefix
from asyncpaged.core import block_pool_report as report
from asyncpaged.core import block_pool_speculative as spec
from asyncpaged.core import block_pool_swap as swap
from asyncpaged.core import block_pool_write as write
from asyncpaged.core.block_pool_checks import (
    check_settled,
    check_sizes,
    check_tokens,
    device_table,
    table_of,
)
from asyncpaged.core.block_table import (
    LATE_TOKEN,
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
from asyncpaged.core.kv_tiers import TierIndex, TierOp
from asyncpaged.core.physical_blocks import PhysicalBlocks
from asyncpaged.core.prefix_hash import BlockHash
from asyncpaged.errors import BlockPoolError

__all__ = ["BlockPool"]


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
    * A late token (:data:`LATE_TOKEN`, async scheduling) is a table's last token, appended
      alone; a block it fills is neither hashed nor registered until :meth:`set_late_token`
      gives it its value. Until then the sequence can neither grow, fork, truncate nor swap.
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
        check_sizes(num_device_blocks, num_host_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._prompt_hashes = prefix.PromptHashes(block_size)  # a cache of a pure function
        self.device = PhysicalBlocks(num_device_blocks, block_size, cacheable=enable_prefix_caching)
        self.host = PhysicalBlocks(num_host_blocks, block_size, cacheable=False)
        self._tables: dict[SeqId, BlockTable] = {}
        self._pins: dict[int, tuple[int, ...]] = {}
        self._swaps: dict[int, swap.SwapInFlight] = {}
        self._forked: set[SeqId] = set()
        self._speculative: dict[SeqId, spec.SpeculativeTail] = {}
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
        return counts.shared_tails(self._forked, self._tables, self.device)

    def release_counts(self, seq_ids: Sequence[SeqId]) -> tuple[int, int] | None:
        """(blocks that freeing the group would release, distinct blocks it holds), or None
        unless every sequence of the group is on the device."""
        return counts.release_counts(self._tables, self.device.ref_cnt, seq_ids)

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def block_ids(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(table_of(self._tables, seq_id).block_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        return table_of(self._tables, seq_id).num_tokens

    def location(self, seq_id: SeqId) -> Location:
        return table_of(self._tables, seq_id).location

    def lookup_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> PrefixHit:
        """The cached full blocks that a prompt ``token_ids`` would reuse (never its last token)."""
        return prefix.lookup(self.device, token_ids, extra_key, caching=self.enable_prefix_caching)

    def num_blocks_to_allocate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        extra_key: str | None = None,
        read_cache: bool = True,
    ) -> int:
        """Allocatable device blocks that :meth:`allocate` with these arguments would consume."""
        check_tokens(token_ids)
        plan = counts.plan_allocation(self.device, self.tiers, self._prompt_hashes, token_ids,
                                      max_new_tokens, extra_key, read_cache,
                                      self.enable_prefix_caching)  # fmt: skip
        return plan.num_blocks

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
        table = device_table(self._tables, seq_id, "append to")
        return counts.num_blocks_to_append(self.device, table, num_tokens)

    def num_blocks_to_append_all(self, appends: Sequence[tuple[SeqId, int]]) -> int:
        """Device blocks that these appends (sequence, number of tokens), run in order, take:
        exact for siblings sharing a partial last block (the last of its holders to append
        writes in place, the others copy it)."""
        return counts.num_blocks_to_append_all(self._tables, self.device, appends)

    @property
    def num_blocks_coming(self) -> int:
        """Device blocks that the swap-outs in flight release when their copies complete."""
        return swap.num_blocks_coming(self.device, self._swaps.values())

    def can_append(self, seq_id: SeqId, num_tokens: int = 1) -> bool:
        return self.num_blocks_to_append(seq_id, num_tokens) <= self.device.num_allocatable

    def num_blocks_to_swap(self, seq_ids: Sequence[SeqId], direction: SwapDirection) -> int:
        """Blocks a swap of this group takes in the destination pool (shared blocks once)."""
        tables = swap.swap_group(self._tables, self._speculative, seq_ids, direction)
        return len(swap.distinct_blocks(tables))

    def can_swap_out(self, seq_ids: Sequence[SeqId]) -> bool:
        return self.num_blocks_to_swap(seq_ids, SwapDirection.OUT) <= self.host.num_allocatable

    def has_speculative_tokens(self, seq_id: SeqId) -> bool:
        """Whether the sequence holds proposals not yet verified (see :meth:`truncate`)."""
        table_of(self._tables, seq_id)
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
        check_tokens(token_ids)
        plan = counts.plan_allocation(self.device, self.tiers, self._prompt_hashes, token_ids,
                                      max_new_tokens, extra_key, read_cache,
                                      self.enable_prefix_caching)  # fmt: skip
        if plan.num_blocks > self.device.num_allocatable:
            return None
        return write.allocate_table(self, self._tables, seq_id, token_ids, plan, extra_key)

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
        table = device_table(self._tables, seq_id, "append to")
        check_tokens(token_ids)
        if len(token_ids) > 1 and LATE_TOKEN in token_ids:
            raise BlockPoolError("a late token is appended alone.")
        check_settled(table, "append to", caching=self.enable_prefix_caching)
        spec.check_num_speculative(num_speculative_tokens, len(token_ids))
        spec.check_verified(self._speculative, seq_id, "append to")
        need = counts.num_blocks_to_append(self.device, table, len(token_ids))
        if need > self.device.num_allocatable:
            return None
        cow = write.copy_on_write(self.device, table)
        self.num_cow_copies += len(cow)
        caching = self.enable_prefix_caching
        if num_speculative_tokens:
            self._speculative[seq_id] = spec.speculative_tail(
                table, token_ids, num_speculative_tokens, self.block_size, caching
            )
        num_verified = len(token_ids) - num_speculative_tokens
        slots = write.write_slots(self.device, table, token_ids, num_verified, caching=caching)
        return AppendResult(slot_mapping=slots, copy_on_write=cow)

    def append_token(self, seq_id: SeqId, token: int) -> int | None:
        """The decode fast path of :meth:`append`: the slot of one token appended into the
        sequence's exclusive partial last block (no allocation, no copy). None, with nothing
        changed, when that does not apply (use :meth:`append`)."""
        table = self._tables.get(seq_id)
        if table is None or table.location is not Location.DEVICE or seq_id in self._speculative:
            return None
        bs, device = self.block_size, self.device  # inline, not in block_pool_write: per token
        offset = table.num_tokens % bs
        if not offset:
            return None
        block = table.block_ids[-1]
        if device.ref_cnt[block] != 1:
            return None
        if device.num_filled[block] != offset:  # dead slots past a truncation
            write.set_filled(device, block, offset)
        device.fill(block, 1)
        table.num_tokens += 1
        if self.enable_prefix_caching:
            partial = table.partial_token_ids
            if partial[-1] == LATE_TOKEN:  # (a partial block: never empty here)
                check_settled(table, "append to", caching=True)
            partial.append(token)
            if offset + 1 == bs and token != LATE_TOKEN:
                device.register(block, prefix.seal_full_block(table))
        return block * bs + offset

    def set_late_token(self, seq_id: SeqId, token: int) -> None:
        """The value of the :data:`LATE_TOKEN` last appended to a device sequence (async
        scheduling: the step that sampled it returned after the next one was planned). A
        block it filled is hashed and registered in the prefix cache now."""
        table = device_table(self._tables, seq_id, "set a late token of")
        write.set_late_token(self.device, table, token, caching=self.enable_prefix_caching)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give ``child_id`` the parent's table, sharing every block (never allocates)."""
        parent = device_table(self._tables, parent_id, "fork")
        spec.check_verified(self._speculative, parent_id, "fork")
        check_settled(parent, "fork", caching=self.enable_prefix_caching)
        write.fork_table(self.device, self._tables, self._forked, parent, child_id)

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence and its references, tail first, wherever its blocks are.

        Blocks of a swap in flight stay held by the swap until :meth:`complete_swap`.
        """
        table = table_of(self._tables, seq_id)
        del self._tables[seq_id]
        self._forked.discard(seq_id)
        self._speculative.pop(seq_id, None)
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
        table = device_table(self._tables, seq_id, "truncate")
        return spec.truncate_table(self.device, table, num_tokens, self._speculative, self._forked,
                                   caching=self.enable_prefix_caching)  # fmt: skip

    # ---- swap -----------------------------------------------------------------------------

    def swap_out(self, seq_ids: Sequence[SeqId]) -> SwapPlan | None:
        """Map every device block of a sequence group to a new host block, all or nothing.

        Blocks shared inside the group get one host block, so the sharing survives. The group
        moves to SWAPPING_OUT; both ends of each copy stay in flight until :meth:`complete_swap`.
        Returns None, and changes nothing, when the host pool is short.
        """
        return swap.start_swap(self.device, self.host, self._tables, self._speculative, self._swaps,
                               self._ids, seq_ids, SwapDirection.OUT,
                               caching=self.enable_prefix_caching)  # fmt: skip

    def swap_in(self, seq_ids: Sequence[SeqId]) -> SwapPlan | None:
        """The reverse of :meth:`swap_out`, for a group on the host; None if the device is short."""
        return swap.start_swap(self.device, self.host, self._tables, self._speculative, self._swaps,
                               self._ids, seq_ids, SwapDirection.IN,
                               caching=self.enable_prefix_caching)  # fmt: skip

    def num_blocks_freed_by_swap(self, swap_id: int) -> int:
        """Source blocks that completing this swap would release (their only holder is it)."""
        return swap.num_blocks_freed(self.device, self.host, self._swaps, swap_id)

    def complete_swap(self, swap_id: int) -> None:
        """The copies of a swap are done: release the in-flight holds, finish the moves."""
        swap.complete_swap(self.device, self.host, self._swaps, self._tables, swap_id,
                           caching=self.enable_prefix_caching)  # fmt: skip

    # ---- explicit prefixes, eviction and the KV tiers -------------------------------------

    def pin_prefix(
        self, token_ids: Sequence[int], extra_key: str | None = None
    ) -> PinnedPrefix | None:
        """Hold the cached blocks of every full block of ``token_ids`` until unpinned.

        Returns None, and changes nothing, unless all those blocks are cached (compute the prefix
        first, for example as a request's prompt, and pin it before that request frees it).
        """
        return prefix.pin_full_blocks(self.device, self._pins, self._ids, token_ids, extra_key,
                                      caching=self.enable_prefix_caching)  # fmt: skip

    def unpin_prefix(self, pin_id: int) -> None:
        prefix.unpin(self.device, self._pins, pin_id)

    def evict_cached_blocks(self, num_blocks: int | None = None) -> int:
        """Evict up to ``num_blocks`` unheld cached blocks (all if None), least recently used
        first; returns how many were evicted."""
        return self.device.evict(num_blocks)

    def persist_tiers(self) -> tuple[TierOp, ...]:
        """Copy every cached device block (least recently used first, pinned ones last) and
        every host-tier entry down to the disk tier; the device cache is left as it is. For a
        shutdown with nothing running: returns the ops to run."""
        return prefix.persist_to_tiers(self.device, self.tiers, self._pins.values())

    def begin_tier_txn(self, failed_spills: Iterable[BlockHash] = ()) -> None:
        """Start a transaction for the tiers (see :meth:`TierIndex.begin`)."""
        if self.tiers is not None:
            self.tiers.begin(failed_spills)

    def drain_tier_ops(self) -> tuple[TierOp, ...]:
        """The tier copies decided since the last call, in order (run before the next step)."""
        return self.tiers.drain_ops() if self.tiers is not None else ()

    # ---- statistics and checks ------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        return report.pool_statistics(self, num_seqs=len(self._tables), num_pins=len(self._pins),
                                      num_swaps_in_flight=len(self._swaps))  # fmt: skip

    def state(self) -> tuple[object, ...]:
        """A comparable snapshot of the whole pool (O(pool); for tests)."""
        return report.pool_state(self, self._tables, self._pins, self._swaps, self._speculative)

    def check_invariants(self) -> None:
        """Assert every invariant of the class docstring (O(pool); for tests)."""
        report.check_pool(self, self._tables, self._pins, self._swaps, self._speculative)
