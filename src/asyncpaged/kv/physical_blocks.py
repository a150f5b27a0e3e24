"""One pool of physical KV blocks: reference counts, the free queue and the prefix-cache LRU.

Every block id in ``[0, num_blocks)`` is in exactly one of four states::

      fresh ──take──► held ◄──hit (incref)── evictable
    (id >= next_fresh)  │ ▲                    ▲  (ref 0, hashed; LRU order)
                        │ └──take (evict LRU)──┤
                        └──last ref dropped────┴──► free (ref 0, no hash; FIFO queue)

Fresh blocks are the never-used tail of the pool, kept as a watermark so that building a pool of
a million blocks costs two list allocations and no queue entries. Every operation is
O(blocks touched).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from asyncpaged.kv.block_table import PoolUsage
from asyncpaged.kv.prefix_hash import BlockHash


class PhysicalBlocks:
    """Reference-counted physical blocks of one pool (device or host).

    Invariants (checked by :meth:`check_invariants`):

    * Each block is exactly one of: fresh (``id >= next_fresh``), free (in the free queue),
      evictable (``ref_cnt == 0`` and hashed, in the LRU), held (``ref_cnt > 0``).
    * ``ref_cnt[b]`` counts every holder of ``b``: block tables, pins and in-flight copies.
    * An in-flight block (``in_flight[b] > 0``) is held: ``ref_cnt[b] >= in_flight[b]``; it is never
      free, never evictable, and so never handed out by :meth:`take`.
    * The hash registry is a bijection between registered blocks and their hashes; only blocks of
      a pool built with ``cacheable=True`` are ever registered.
    * ``num_held`` is the number of held blocks, ``num_shared`` the number with more than one
      holder, and ``num_filled_held`` the sum of ``num_filled`` over the held blocks.
    """

    __slots__ = (
        "_block_of",
        "_evictable",
        "_free",
        "_hash_of",
        "_next_fresh",
        "block_size",
        "cacheable",
        "in_flight",
        "num_blocks",
        "num_filled",
        "num_filled_held",
        "num_held",
        "num_shared",
        "on_evict",
        "ref_cnt",
    )

    def __init__(self, num_blocks: int, block_size: int, *, cacheable: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cacheable = cacheable
        self.ref_cnt = [0] * num_blocks
        self.num_filled = [0] * num_blocks  # slots written in each block
        self.in_flight: dict[int, int] = {}  # block -> number of copies in flight
        self.num_held = 0
        self.num_shared = 0  # blocks with more than one holder
        self.num_filled_held = 0
        self._next_fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        # Called with (block, hash) when a cached block is evicted, before it is reused (the
        # KV tiers offload it); None: evicted blocks are forgotten.
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_allocatable(self) -> int:
        """Blocks that :meth:`take` can hand out now (free, fresh, or evictable)."""
        return self.num_blocks - self.num_held

    @property
    def num_free(self) -> int:
        """Blocks that are neither held nor cached."""
        return self.num_blocks - self.num_held - len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    # ---- taking and releasing -------------------------------------------------------------

    def take(self, after: int | None = None) -> int:
        """Hand out one block with ``ref_cnt == 1`` and nothing filled.

        Placement: the block right after ``after`` if it is free or fresh (keeps a sequence's
        blocks in physical runs), else the oldest free block, else the next fresh block, else the
        least recently used cached block, which is evicted. The caller has checked capacity.
        """
        assert self.num_held < self.num_blocks, "take() on a pool with no allocatable block"
        nxt = -1 if after is None else after + 1
        if nxt == self._next_fresh and nxt < self.num_blocks:
            block = nxt
            self._next_fresh += 1
        elif nxt in self._free:
            block = nxt
            del self._free[block]
        elif self._free:
            block, _ = self._free.popitem(last=False)
        elif self._next_fresh < self.num_blocks:
            block = self._next_fresh
            self._next_fresh += 1
        else:
            block, _ = self._evictable.popitem(last=False)
            self._evicted(block)
        self.ref_cnt[block] = 1
        self.num_filled[block] = 0
        self.num_held += 1
        return block

    def incref(self, block: int) -> None:
        """Add a holder; a cached block with no holder leaves the LRU (a prefix-cache hit)."""
        if self.ref_cnt[block] == 0:
            assert block in self._evictable, f"incref of unheld, uncached block {block}"
            del self._evictable[block]
            self.num_held += 1
            self.num_filled_held += self.num_filled[block]
        elif self.ref_cnt[block] == 1:
            self.num_shared += 1
        self.ref_cnt[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one holder of each block, tail first.

        Blocks whose last holder left become evictable if hashed (the tail enters the LRU first,
        so it is evicted first) or free otherwise (queued head first, so that a later sequence
        taking them with :meth:`take` gets them in their old physical order).
        """
        freed: list[int] = []
        for block in reversed(blocks):
            assert self.ref_cnt[block] > 0, f"release of unheld block {block}"
            if self.ref_cnt[block] == 2:
                self.num_shared -= 1
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.num_held -= 1
                self.num_filled_held -= self.num_filled[block]
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    freed.append(block)
        for block in reversed(freed):
            self._free[block] = None

    def fill(self, block: int, num_slots: int) -> None:
        """Record ``num_slots`` more written slots in a held block."""
        assert self.ref_cnt[block] > 0
        self.num_filled[block] += num_slots
        assert self.num_filled[block] <= self.block_size
        self.num_filled_held += num_slots

    def set_filled(self, block: int, num_slots: int) -> None:
        """Make an exclusively held block's written-slot count ``num_slots``: the slots past it
        are dead (truncated away, or a sibling's that freed the block since)."""
        self.fill(block, num_slots - self.num_filled[block])

    # ---- in-flight copies -----------------------------------------------------------------

    def hold_in_flight(self, block: int) -> None:
        """Mark a held block as the source or destination of a copy in flight (adds a holder)."""
        self.incref(block)
        self.in_flight[block] = self.in_flight.get(block, 0) + 1

    def mark_in_flight(self, block: int) -> None:
        """Turn the single holder of a just-taken block into an in-flight hold."""
        assert self.ref_cnt[block] == 1
        assert block not in self.in_flight
        self.in_flight[block] = 1

    def release_in_flight(self, blocks: Iterable[int]) -> None:
        """End the in-flight hold on each block (the copy is done)."""
        for block in blocks:
            count = self.in_flight[block] - 1
            if count:
                self.in_flight[block] = count
            else:
                del self.in_flight[block]
            self.release((block,))

    # ---- prefix-cache registry ------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Make a held, full block findable by its hash; False if another block has that hash."""
        assert self.cacheable
        assert self.ref_cnt[block] > 0
        assert block not in self._hash_of
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def evict(self, num_blocks: int | None = None) -> int:
        """Evict up to ``num_blocks`` (all if None) cached blocks, LRU first; returns the count."""
        count = 0
        while self._evictable and (num_blocks is None or count < num_blocks):
            block, _ = self._evictable.popitem(last=False)
            self._evicted(block)
            self._free[block] = None
            count += 1
        return count

    def _unregister(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]

    def _evicted(self, block: int) -> None:
        block_hash = self._hash_of[block]
        self._unregister(block)
        if self.on_evict is not None:
            self.on_evict(block, block_hash)

    # ---- introspection --------------------------------------------------------------------

    def usage(self) -> PoolUsage:
        """The blocks by state: free, used (held, not in flight), cached, in flight."""
        in_flight = len(self.in_flight)
        return PoolUsage(
            total=self.num_blocks,
            free=self.num_free,
            used=self.num_held - in_flight,
            cached=self.num_evictable,
            in_flight=in_flight,
        )

    def evictable_blocks(self) -> list[int]:
        """Cached blocks with no holder, in eviction order (for tests and statistics)."""
        return list(self._evictable)

    def free_blocks(self) -> list[int]:
        """Free (unhashed, unheld) blocks in the order :meth:`take` hands them out, fresh last."""
        return [*self._free, *range(self._next_fresh, self.num_blocks)]

    def state(self) -> tuple[object, ...]:
        """A comparable snapshot of everything (O(pool); tests use it to prove no change)."""
        return (
            tuple(self.ref_cnt),
            tuple(self.num_filled),
            tuple(sorted(self.in_flight.items())),
            self._next_fresh,
            tuple(self._free),
            tuple(self._evictable),
            tuple(sorted(self._hash_of.items())),
        )

    def check_invariants(self, expected_refs: list[int]) -> None:
        """Assert the class invariants, given the holders the owner counted for each block."""
        assert self.ref_cnt == expected_refs, "reference counts differ from the holders"
        held = [b for b in range(self.num_blocks) if self.ref_cnt[b] > 0]
        assert self.num_held == len(held)
        assert self.num_shared == sum(1 for b in held if self.ref_cnt[b] > 1)
        assert self.num_filled_held == sum(self.num_filled[b] for b in held)
        for block, count in self.in_flight.items():
            assert count > 0
            assert self.ref_cnt[block] >= count
        fresh = set(range(self._next_fresh, self.num_blocks))
        free, evictable = set(self._free), set(self._evictable)
        assert not (free & evictable)
        assert not (free & fresh)
        assert not (evictable & fresh)
        assert len(free) + len(evictable) + len(fresh) + len(held) == self.num_blocks
        assert all(self.ref_cnt[b] == 0 and b not in self._hash_of for b in free | fresh)
        assert all(self.ref_cnt[b] == 0 and b in self._hash_of for b in evictable)
        assert {self._block_of[h]: h for h in self._block_of} == self._hash_of
        assert self.cacheable or not self._hash_of
