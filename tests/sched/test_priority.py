"""The priority policy on the real scheduler and pool, driven by the fake KV world.

Scenarios pin who finishes first and that preemption never changes a request's tokens (the
fake world's next token is a hash of the K/V a sequence reads back); a Hypothesis run checks
outputs and the rank-order rules under random arrivals, priorities, aborts and swap timing.
"""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import event, given

from asyncpaged.errors import InvalidRequestError
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
from asyncpaged.kv.txn import PriorityPreemption, StepTxn, apply_txn, snapshot
from asyncpaged.sched.policy import QueuePolicy, check_priority, num_outranked
from asyncpaged.sched.request import Request, Sequence, StopCriteria
from asyncpaged.sched.scheduler import Scheduler, SchedulerConfig
from tests.sched.rows import rows_of
from tests.sched.test_scheduler_property import BASE, BS, EOS, FakeWorld, reference_output


class Driver:
    """Runs a scheduler + pool + fake world step by step, recording finish order."""

    def __init__(
        self, config: SchedulerConfig, num_host: int = 0, tiers: TierIndex | None = None
    ) -> None:
        self.pool = BlockPool(config.num_device_blocks, num_host, block_size=BS, tiers=tiers)
        self.host_tier: dict[int, Any] = {}  # fake KV tier contents, slot * BS + offset
        self.disk_tier: dict[bytes, list[Any]] = {}
        self.sched = Scheduler(config)
        self.snap = snapshot(self.pool)
        self.world = FakeWorld()
        self.every: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.num_steps = 0
        self._ids = itertools.count()

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0) -> None:
        seq = Sequence(seq_id=next(self._ids), index=0, token_ids=list(prompt),
                       num_prompt_tokens=len(prompt))  # fmt: skip
        stop = StopCriteria(max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), ignore_eos=True)
        request = Request(request_id=rid, arrival=len(self.every), seqs=[seq], stop=stop,
                          priority=priority)  # fmt: skip
        self.every[rid] = request
        self.outputs[rid] = []
        self.sched.add_request(request)

    def step(self) -> None:
        txn = self.sched.plan(self.snap)
        result = apply_txn(self.pool, txn)
        self.snap = result.snapshot
        self.replay_tiers(result.tier_ops)  # before the step and its swaps, as the engine does
        out = self.sched.apply(txn, result)
        sampled, tops = self.world.execute(out, self.every)
        for upd in self.sched.update(out, rows_of(out, sampled, tops)):
            self.outputs[upd.request_id].extend(upd.new_token_ids)
            if upd.finish_reason is not None:
                self.finished.append(upd.request_id)
        for swap_id in sorted(self.world.swaps):  # swaps land by the next step
            self.world.complete(swap_id)
            self.sched.complete_swap(swap_id)
        self.pool.check_invariants()
        self.num_steps += 1

    def replay_tiers(self, ops: tuple[TierOp, ...]) -> None:
        dev, host = self.world.device, self.host_tier
        for op in ops:
            match op:
                case OffloadOp(device_block=b, host_slot=s):
                    for off in range(BS):
                        host[s * BS + off] = dev.get(b * BS + off)
                case SpillOp(host_slot=s, block_hash=h):
                    self.disk_tier[h] = [host.get(s * BS + off) for off in range(BS)]
                case RestoreHostOp(host_slot=s, device_block=b):
                    for off in range(BS):
                        dev[b * BS + off] = host.get(s * BS + off)
                case RestoreDiskOp(block_hash=h, device_block=b):
                    for off, content in enumerate(self.disk_tier[h]):
                        dev[b * BS + off] = content
                case DropDiskOp(block_hash=h):
                    del self.disk_tier[h]

    def run(self, max_steps: int = 2000) -> None:
        while self.sched.has_unfinished or self.sched.has_pending_txn_work:
            self.step()
            assert self.num_steps < max_steps, "no progress"

    def check_outputs(self) -> None:
        for rid, request in self.every.items():
            prompt = request.seqs[0].token_ids[: request.seqs[0].num_prompt_tokens]
            assert self.outputs[rid] == reference_output(prompt, None, request.stop, 0), rid


def config(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "block_size": BS, "num_device_blocks": 64, "max_num_seqs": 8,
        "max_num_batched_tokens": 64, "scheduling_policy": "priority",
    }  # fmt: skip
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_high_priority_preempts_when_max_num_seqs_is_spent(mode: str) -> None:
    d = Driver(config(max_num_seqs=1, preemption_mode=mode), num_host=32)
    d.add("low", [1, 2, 3, 1, 2], max_tokens=30, priority=5)
    for _ in range(5):
        d.step()
    assert d.sched.running[0].request_id == "low"
    d.add("high", [3, 3, 2], max_tokens=5, priority=0)
    d.run()
    assert d.finished == ["high", "low"]
    assert d.sched.statistics().num_preemptions == 1
    assert (d.sched.num_swap_outs == 1) is (mode == "swap")
    d.check_outputs()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_high_priority_preempts_when_the_kv_pool_is_full(mode: str) -> None:
    # 8 device blocks of 4: the low request's 20 + 10 tokens fill them.
    d = Driver(config(num_device_blocks=8, preemption_mode=mode, watermark=0.0), num_host=16)
    d.add("low", [1, 2, 3, 0] * 5, max_tokens=10, priority=1)
    for _ in range(3):
        d.step()
    d.add("high", [2, 1] * 6, max_tokens=8, priority=-3)
    d.run()
    assert d.finished == ["high", "low"]
    assert d.sched.statistics().num_preemptions >= 1
    d.check_outputs()


def test_fcfs_never_preempts_for_a_waiting_request() -> None:
    d = Driver(config(max_num_seqs=1, scheduling_policy="fcfs"))
    d.add("first", [1, 2, 3], max_tokens=10)
    d.step()
    d.add("second", [3, 2, 1], max_tokens=2)
    d.run()
    assert d.finished == ["first", "second"]
    assert d.sched.statistics().num_preemptions == 0


def test_equal_priorities_are_first_come_first_served() -> None:
    d = Driver(config(max_num_seqs=1))
    for i in range(4):
        d.add(f"r{i}", [i % 4, 1, 2], max_tokens=3, priority=2)
    d.run()
    assert d.finished == ["r0", "r1", "r2", "r3"]
    assert d.sched.statistics().num_preemptions == 0


def test_aging_bounds_starvation() -> None:
    """A priority-9 request under an endless stream of priority-0 ones still runs: after
    9 * aging_steps plans of waiting it ranks with them and, older, goes first."""
    aging = 4
    d = Driver(config(max_num_seqs=1, priority_aging_steps=aging))
    d.add("low", [1, 1, 1], max_tokens=2, priority=9)
    n = 0
    while "low" not in d.finished:
        if len(d.sched.waiting) < 2:  # always a high-priority request waiting
            d.add(f"high{n}", [2, 2, n % 4], max_tokens=2, priority=0)
            n += 1
        d.step()
        assert d.num_steps < 9 * aging + 20, "the low-priority request starved"
    assert d.num_steps >= 9 * aging  # it did wait behind the stream until then
    d.run()
    d.check_outputs()


def test_without_aging_credit_a_stream_would_starve_it() -> None:
    """The same stream with aging too slow to matter: the test above can fail."""
    d = Driver(config(max_num_seqs=1, priority_aging_steps=10**6))
    d.add("low", [1, 1, 1], max_tokens=2, priority=9)
    for n in range(60):
        if len(d.sched.waiting) < 2:
            d.add(f"high{n}", [2, 2, n % 4], max_tokens=2, priority=0)
        d.step()
    assert "low" not in d.finished


def test_num_outranked_counts_from_the_end() -> None:
    policy = QueuePolicy("priority")

    def req(rid: str, priority: int) -> Request:
        r = Request(request_id=rid, arrival=0, seqs=[], stop=StopCriteria(max_tokens=1),
                    priority=priority)  # fmt: skip
        policy.on_add(r)
        return r

    running = [req("a", 0), req("b", 3), req("c", 5)]
    assert num_outranked(policy, req("w", 1), running) == 2  # c and b, not a
    assert num_outranked(policy, req("w", 5), running) == 0  # ties do not preempt
    assert num_outranked(QueuePolicy("fcfs"), req("w", 0), running) == 0


def test_claim_takes_the_fewest_victims_or_none() -> None:
    """The allocator's side of a priority preemption: victims from the front of ``victims`` until
    the
    released blocks (counted once when victims share them) and sequences cover it; all or none."""

    def pool_with_shared_prefix() -> BlockPool:
        pool = BlockPool(8, 0, block_size=BS)
        prefix = list(range(BS))
        for seq_id in (0, 1, 2):  # one shared full block, one block of its own each
            assert pool.allocate(seq_id, [*prefix, 100 + seq_id]) is not None
        return pool

    victims = ((2,), (1,), (0,))
    cases = [  # (preemption, victims preempted)
        (PriorityPreemption(num_victims=2, num_seqs=1, blocks=4 + 1), 1),
        # The shared block is released only when its last holder goes: 2 victims free 2, not 3.
        (PriorityPreemption(num_victims=2, num_seqs=0, blocks=4 + 2), 2),
        (PriorityPreemption(num_victims=2, num_seqs=0, blocks=4 + 3), 0),  # none
        (PriorityPreemption(num_victims=3, num_seqs=0, blocks=4 + 4), 3),  # the shared one too
        (PriorityPreemption(num_victims=3, num_seqs=3, blocks=0), 3),
        (PriorityPreemption(num_victims=2, num_seqs=3, blocks=0), 0),
    ]  # fmt: skip
    for preemption, expected in cases:
        pool = pool_with_shared_prefix()
        assert pool.num_free_device_blocks == 4
        txn = StepTxn(victims=victims, preemption=preemption, append_group_sizes=())
        result = apply_txn(pool, txn)
        assert result.preempted == (False,) * expected, preemption
        assert pool.num_free_device_blocks == 4 + [0, 1, 2, 4][expected], preemption
        pool.check_invariants()


@pytest.mark.parametrize("bad", [True, 1.0, "1", None])
def test_priority_must_be_an_int(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match="priority must be an int"):
        check_priority(bad, "priority")


def test_fcfs_refuses_nonzero_priority() -> None:
    assert check_priority(0, "fcfs") == 0
    assert check_priority(-7, "priority") == -7
    with pytest.raises(InvalidRequestError, match="not enabled"):
        check_priority(1, "fcfs")


@given(data=st.data())
def test_random_priorities_keep_every_output(data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(["recompute", "swap"]))
    num_device = data.draw(st.integers(8, 24))
    cfg = config(num_device_blocks=num_device, max_num_seqs=data.draw(st.integers(1, 4)),
                 max_num_batched_tokens=data.draw(st.integers(4, 32)), preemption_mode=mode,
                 priority_aging_steps=data.draw(st.integers(1, 8)))  # fmt: skip
    tiers = None
    if data.draw(st.booleans(), label="kv tiers"):
        tiers = TierIndex(data.draw(st.integers(0, 6)), data.draw(st.integers(0, 6)))
    d = Driver(cfg, num_host=data.draw(st.integers(0, 24)), tiers=tiers)
    max_len = (num_device - 2) * BS
    n = data.draw(st.integers(1, 8))
    late = data.draw(st.integers(0, 6))

    def add() -> None:
        shared = BASE[: data.draw(st.integers(0, 16))]  # shared prefixes: cache and tier hits
        tail = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=6))
        prompt = (shared + tail)[: max_len - 8]
        d.add(f"r{len(d.every)}", prompt, max_tokens=data.draw(st.integers(1, 8)),
              priority=data.draw(st.integers(-2, 2)))  # fmt: skip

    for _ in range(n):
        add()
    while d.sched.has_unfinished or d.sched.has_pending_txn_work or late:
        d.step()
        assert d.num_steps < 3000
        if late and data.draw(st.booleans()):
            add()
            late -= 1
    d.check_outputs()
    if d.sched.num_preemptions:
        event("preempted")
    if d.pool.statistics().prefix_host_hit_tokens or d.pool.statistics().prefix_disk_hit_tokens:
        event("tier hit")
    stats = d.pool.statistics()
    assert stats.num_seqs == 0 and stats.device.used == 0 and stats.host.used == 0
