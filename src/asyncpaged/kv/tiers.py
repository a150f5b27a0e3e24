"""The KV tiers below the device prefix cache: a host-RAM tier and a disk tier (pure Python).

A full, hashed device block evicted from the prefix cache's LRU is *offloaded*: copied into a
host slot. A host entry evicted from the host LRU is *spilled*: written to a file. A prefix
lookup that misses on device continues down the same hash chain here, and a hit is *restored*
into a new device block instead of being recomputed::

    device LRU ──evict──► host tier (slots, LRU) ──evict──► disk tier (files, LRU, budget)
         ▲                     │                                │
         └──── restore ────────┴──────────── restore ───────────┘

This module is the index only: it decides, and records each copy as a :data:`TierOp` in the
order the decisions were made. The tier store (``worker/kv_tier_store.py``) replays the ops in
that order, before the step whose transaction produced them, so every op sees the data the
previous ones left (a restore reads a host slot before a later op in the same transaction
reuses it; a spill reads a slot before an offload overwrites it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from asyncpaged.kv.prefix_hash import BlockHash

TierName = Literal["host", "disk"]


@dataclass(frozen=True, slots=True)
class OffloadOp:
    """Copy device block ``device_block`` into host slot ``host_slot``."""

    device_block: int
    host_slot: int


@dataclass(frozen=True, slots=True)
class SpillOp:
    """Write host slot ``host_slot`` to the disk entry of ``block_hash``."""

    host_slot: int
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class RestoreHostOp:
    """Copy host slot ``host_slot`` into device block ``device_block``."""

    host_slot: int
    device_block: int


@dataclass(frozen=True, slots=True)
class RestoreDiskOp:
    """Read the disk entry of ``block_hash`` into device block ``device_block``."""

    block_hash: BlockHash
    device_block: int


@dataclass(frozen=True, slots=True)
class DropDiskOp:
    """Delete the disk entry of ``block_hash`` (evicted from the disk tier)."""

    block_hash: BlockHash


TierOp = OffloadOp | SpillOp | RestoreHostOp | RestoreDiskOp | DropDiskOp


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStatistics:
    num_host_slots: int
    num_host_entries: int
    num_disk_entries: int
    disk_budget_entries: int
    num_offloads: int
    num_spills: int
    num_host_restores: int
    num_disk_restores: int


class TierIndex:
    """Where each evicted block's K/V lives below the device: host slots and disk entries.

    Invariants (:meth:`check_invariants`):

    * Host: ``_host`` (hash -> slot, least recently used first) and ``_free_slots`` partition
      ``range(num_host_slots)``; no slot holds two hashes.
    * Disk: ``len(_disk) <= disk_budget_entries`` (the byte budget over the fixed entry size:
      a budget is never exceeded); ``_pending`` (spilled in this transaction, file not yet
      known to be written) is a subset of ``_disk`` and is never matched, so a failed write is
      forgotten (:meth:`forget`) before any lookup can read it.
    * A hash may be in both tiers (a restored or re-offloaded block keeps its disk entry).
    * ``_protected`` hashes (a restore being recorded) are never evicted from the host.
    * Ops are recorded in decision order; :meth:`drain_ops` hands them out once.
    """

    def __init__(
        self,
        num_host_slots: int,
        disk_budget_entries: int = 0,
        disk_entries: Iterable[BlockHash] = (),
    ) -> None:
        """``disk_entries``: verified entries found on disk at start, least recently used
        first (the store drops the excess over the budget before)."""
        if num_host_slots < 0 or disk_budget_entries < 0:
            raise ValueError("tier sizes must be non-negative.")
        self.num_host_slots = num_host_slots
        self.disk_budget_entries = disk_budget_entries
        self._host: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots: list[int] = list(range(num_host_slots - 1, -1, -1))
        self._disk: OrderedDict[BlockHash, None] = OrderedDict()
        for h in disk_entries:
            self._disk[h] = None
        assert len(self._disk) <= disk_budget_entries, "more disk entries than the budget"
        self._pending: set[BlockHash] = set()
        self._protected: set[BlockHash] = set()
        self._ops: list[TierOp] = []
        self.num_offloads = self.num_spills = 0
        self.num_host_restores = self.num_disk_restores = 0

    # ---- transactions ---------------------------------------------------------------------

    def begin(self, failed_spills: Iterable[BlockHash] = ()) -> None:
        """A new transaction: forget entries whose file could not be written, then make the
        rest of the last transaction's spills matchable."""
        self.forget(failed_spills)
        self._pending.clear()

    def forget(self, hashes: Iterable[BlockHash]) -> None:
        """Drop disk entries known to be unreadable (a failed write; the store removed it)."""
        for h in hashes:
            self._disk.pop(h, None)
            self._pending.discard(h)

    def drain_ops(self) -> tuple[TierOp, ...]:
        ops, self._ops = tuple(self._ops), []
        return ops

    # ---- lookups and restores ---------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> TierName | None:
        """Which tier would restore this block (host first), or None."""
        if block_hash in self._host:
            return "host"
        if block_hash in self._disk and block_hash not in self._pending:
            return "disk"
        return None

    def protect(self, block_hash: BlockHash) -> None:
        """Keep a block's host entry while its restore is being placed (see the pool)."""
        self._protected.add(block_hash)

    def restore(self, block_hash: BlockHash, device_block: int) -> TierName:
        """Record the copy of a found block into ``device_block``; it becomes most recent."""
        self._protected.discard(block_hash)
        slot = self._host.get(block_hash)
        if slot is not None:
            self._host.move_to_end(block_hash)
            self._ops.append(RestoreHostOp(host_slot=slot, device_block=device_block))
            self.num_host_restores += 1
            return "host"
        assert self.lookup(block_hash) == "disk", "restore of a block no tier holds"
        self._disk.move_to_end(block_hash)
        self._ops.append(RestoreDiskOp(block_hash=block_hash, device_block=device_block))
        self.num_disk_restores += 1
        return "disk"

    # ---- offloading -------------------------------------------------------------------------

    def offload(self, device_block: int, block_hash: BlockHash) -> None:
        """A device block is evicted (its data still valid until the ops ran): keep it on the
        host, making room by evicting the host's least recently used entry (spilled to disk
        unless it is there already, or when the disk tier is off)."""
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return
        slot = self._free_slots.pop() if self._free_slots else self._evict_host()
        if slot is None:
            return  # no host tier, or every entry is being restored: the block is dropped
        self._host[block_hash] = slot
        self._ops.append(OffloadOp(device_block=device_block, host_slot=slot))
        self.num_offloads += 1

    def persist(self) -> None:
        """Spill every host entry that has no file yet (shutdown: the disk tier is what
        survives a restart), least recently used first, within the disk budget."""
        for block_hash, slot in list(self._host.items()):
            if block_hash in self._disk:
                self._disk.move_to_end(block_hash)
            elif self._make_disk_room():
                self._disk[block_hash] = None
                self._pending.add(block_hash)
                self._ops.append(SpillOp(host_slot=slot, block_hash=block_hash))
                self.num_spills += 1

    def _evict_host(self) -> int | None:
        victim = next((h for h in self._host if h not in self._protected), None)
        if victim is None:
            return None
        slot = self._host.pop(victim)
        if victim in self._disk:
            self._disk.move_to_end(victim)
        elif self._make_disk_room():
            self._disk[victim] = None
            self._pending.add(victim)
            self._ops.append(SpillOp(host_slot=slot, block_hash=victim))
            self.num_spills += 1
        return slot

    def _make_disk_room(self) -> bool:
        """Drop least recently used disk entries (never protected ones) until one more fits;
        False when the disk tier is off or cannot make room."""
        if not self.disk_budget_entries:
            return False
        while len(self._disk) >= self.disk_budget_entries:
            dropped = next((h for h in self._disk if h not in self._protected), None)
            if dropped is None:
                return False
            del self._disk[dropped]
            self._pending.discard(dropped)
            self._ops.append(DropDiskOp(block_hash=dropped))
        return True

    # ---- statistics and checks --------------------------------------------------------------

    def statistics(self) -> TierStatistics:
        return TierStatistics(
            num_host_slots=self.num_host_slots,
            num_host_entries=len(self._host),
            num_disk_entries=len(self._disk),
            disk_budget_entries=self.disk_budget_entries,
            num_offloads=self.num_offloads,
            num_spills=self.num_spills,
            num_host_restores=self.num_host_restores,
            num_disk_restores=self.num_disk_restores,
        )

    def host_entries(self) -> list[tuple[BlockHash, int]]:
        """(hash, slot), least recently used first (for tests)."""
        return list(self._host.items())

    def disk_entries(self) -> list[BlockHash]:
        """Disk hashes, least recently used first (for tests)."""
        return list(self._disk)

    def state(self) -> tuple[object, ...]:
        """A comparable snapshot (O(entries); tests prove a failed call changed nothing)."""
        return (
            tuple(self._host.items()),
            tuple(self._free_slots),
            tuple(self._disk),
            tuple(sorted(self._pending)),
            tuple(self._ops),
        )

    def check_invariants(self) -> None:
        slots = list(self._host.values())
        assert len(set(slots)) == len(slots), "a host slot holds two blocks"
        assert sorted(slots + self._free_slots) == list(range(self.num_host_slots))
        assert len(self._disk) <= self.disk_budget_entries, "disk budget exceeded"
        assert self._pending <= set(self._disk)
        assert not self._protected, "a protection outlived its restore"


__all__ = [
    "DropDiskOp",
    "OffloadOp",
    "RestoreDiskOp",
    "RestoreHostOp",
    "SpillOp",
    "TierIndex",
    "TierName",
    "TierOp",
    "TierStatistics",
]
