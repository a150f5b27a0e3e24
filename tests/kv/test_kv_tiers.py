"""The KV tiers under the block pool: the pool state machine with host and disk tiers, and
scenarios that pin the tiers' LRU order and budgets.

The state machine is the pool machine (``test_block_pool_state_machine.py``) with a tier index
under the pool. The model replays every tier op on its simulated KV contents the moment the
pool call that decided it returns (before the rule writes new K/V, as the engine runs them
before the step), so a sequence that maps restored blocks must read back exactly its tokens;
a restore of a block whose spill "failed" (the model drops its disk content) finds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.tiers import (
    DropDiskOp,
    OffloadOp,
    RestoreDiskOp,
    RestoreHostOp,
    SpillOp,
    TierIndex,
    TierOp,
)
from tests.kv.test_block_pool_state_machine import (
    BS,
    BlockPoolMachine,
    ModelSeq,
    extra_st,
    prompts_st,
)


class TieredBlockPoolMachine(BlockPoolMachine):
    @initialize(
        num_device=st.integers(4, 16),
        num_host=st.integers(0, 8),
        num_slots=st.sampled_from([0, 1, 1, 2, 3, 6]),
        num_disk=st.sampled_from([0, 2, 8, 8]),
    )
    def init_pool(self, num_device: int, num_host: int, num_slots: int, num_disk: int) -> None:
        self.tiers = TierIndex(num_slots, num_disk)
        self.pool = BlockPool(num_device, num_host, block_size=BS, tiers=self.tiers)
        self.pending_spills: list[bytes] = []
        self.disk_kv: dict[bytes, list[Any]] = {}
        for name in ("allocate", "append", "swap_in", "evict_cached_blocks"):
            setattr(self.pool, name, self._replaying(getattr(self.pool, name)))

    def _replaying(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            self.replay(self.pool.drain_tier_ops())
            return result

        return wrapped

    def replay(self, ops: tuple[TierOp, ...]) -> None:
        kv = self.kv
        for op in ops:
            match op:
                case OffloadOp(device_block=b, host_slot=s):
                    kv[("tier", s)] = list(kv[("device", b)])
                    self.note("offloaded")
                case SpillOp(host_slot=s, block_hash=h):
                    self.disk_kv[h] = list(kv[("tier", s)])
                    self.pending_spills.append(h)
                    self.note("spilled")
                case RestoreHostOp(host_slot=s, device_block=b):
                    kv[("device", b)] = list(kv[("tier", s)])
                    self.note("restored from host")
                case RestoreDiskOp(block_hash=h, device_block=b):
                    assert h in self.disk_kv, "restored a block whose file was never written"
                    kv[("device", b)] = list(self.disk_kv[h])
                    self.note("restored from disk")
                case DropDiskOp(block_hash=h):
                    del self.disk_kv[h]
                    self.note("dropped from disk")

    @rule(
        prompt=prompts_st,
        extra=extra_st,
        chunk=st.none() | st.integers(1, 12),
        spills_failed=st.booleans(),
    )
    def allocate(
        self, prompt: list[int], extra: str | None, chunk: int | None, spills_failed: bool
    ) -> None:
        """An admission in a new transaction (the last one's spills written, or all failed)."""
        self.begin(self.pending_spills if spills_failed else [])
        sid = next(self.ids)
        device_hit = self.pool.lookup_prefix(prompt, extra)
        need = self.pool.num_blocks_to_allocate(prompt, max_new_tokens=chunk, extra_key=extra)
        available = self.available("device")
        before = self.pool.state()
        result = self.pool.allocate(sid, prompt, max_new_tokens=chunk, extra_key=extra)
        self.expect_unchanged_on_none(before, result)
        assert (result is None) == (need > available)
        if result is None:
            return
        assert result.num_cached_tokens >= device_hit.num_tokens
        assert result.num_cached_tokens < len(prompt)
        if result.num_cached_tokens > device_hit.num_tokens:
            self.note("tier hit")
        num_tokens = result.num_cached_tokens + len(result.slot_mapping)
        if chunk is not None:
            assert num_tokens == min(len(prompt), result.num_cached_tokens + chunk)
        seq = self.model[sid] = ModelSeq(prompt[:num_tokens], extra)
        self.write(seq, result.num_cached_tokens, result.slot_mapping)

    @rule(data=st.data())
    def new_transaction(self, data: st.DataObject) -> None:
        """The allocator starts a transaction; some of the last spills failed to write."""
        failed = [h for h in self.pending_spills if data.draw(st.booleans(), label="write failed")]
        self.begin(failed)

    def begin(self, failed: list[bytes]) -> None:
        for h in failed:
            self.disk_kv.pop(h, None)
            self.note("failed spill")
        self.pending_spills = []
        self.pool.begin_tier_txn(failed)

    @precondition(lambda self: hasattr(self, "tiers"))
    @invariant()
    def tier_budgets(self) -> None:
        stats = self.tiers.statistics()
        assert stats.num_host_entries <= stats.num_host_slots
        assert stats.num_disk_entries <= stats.disk_budget_entries
        assert self.pool.drain_tier_ops() == (), "an op was left unreplayed"


TestTieredBlockPoolStateMachine = TieredBlockPoolMachine.TestCase


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_host_lru_spills_to_disk_and_disk_lru_drops_exactly_at_the_budget() -> None:
    tiers = TierIndex(num_host_slots=2, disk_budget_entries=2)
    for i in range(5):
        tiers.offload(device_block=10 + i, block_hash=h(i))
    # Host keeps the 2 newest; the 3 older went to disk, where the oldest was dropped.
    assert [x for x, _ in tiers.host_entries()] == [h(3), h(4)]
    assert tiers.disk_entries() == [h(1), h(2)]
    assert tiers.drain_ops() == (
        OffloadOp(10, 0),
        OffloadOp(11, 1),
        SpillOp(0, h(0)),
        OffloadOp(12, 0),
        SpillOp(1, h(1)),
        OffloadOp(13, 1),
        DropDiskOp(h(0)),
        SpillOp(0, h(2)),
        OffloadOp(14, 0),
    )
    # Spills of this transaction are not matched until the next one begins (and a failed
    # write is forgotten first).
    assert tiers.lookup(h(2)) is None
    tiers.begin(failed_spills=[h(1)])
    assert tiers.lookup(h(1)) is None
    assert tiers.lookup(h(2)) == "disk"
    assert tiers.lookup(h(4)) == "host"
    tiers.check_invariants()


def test_a_hit_refreshes_recency() -> None:
    tiers = TierIndex(num_host_slots=2)
    tiers.offload(0, h(0))
    tiers.offload(1, h(1))
    tiers.protect(h(0))
    assert tiers.restore(h(0), device_block=5) == "host"
    tiers.offload(2, h(2))  # evicts h(1), the least recently used now
    assert [x for x, _ in tiers.host_entries()] == [h(0), h(2)]


def test_protected_entries_survive_their_own_restore() -> None:
    tiers = TierIndex(num_host_slots=1)
    tiers.offload(0, h(0))
    tiers.protect(h(0))
    tiers.offload(1, h(1))  # no room but the protected entry: h(1) is dropped
    assert tiers.restore(h(0), device_block=3) == "host"
    assert [x for x, _ in tiers.host_entries()] == [h(0)]
    tiers.check_invariants()


def test_pool_restores_an_evicted_prefix_from_the_host_tier() -> None:
    tiers = TierIndex(num_host_slots=8)
    pool = BlockPool(4, block_size=BS, tiers=tiers)
    prompt = [1, 2, 3, 0] * 3 + [9]
    assert pool.allocate("a", prompt) is not None
    pool.free("a")  # 3 full blocks cached on device
    assert pool.allocate("b", [3] * 15) is not None  # takes every block: all 3 evicted
    pool.free("b")
    ops = pool.drain_tier_ops()
    assert [type(op) for op in ops] == [OffloadOp] * 3
    got = pool.allocate("c", prompt)
    assert got is not None and got.num_cached_tokens == 12
    stats = pool.statistics()
    assert stats.prefix_host_hit_tokens == 12
    restores = [op for op in pool.drain_tier_ops() if isinstance(op, RestoreHostOp)]
    assert [op.device_block for op in restores] == list(got.block_ids[:3])
    pool.check_invariants()
