"""Async scheduling with speculative decoding in the core, against the fake executor of
``test_scheduler_property`` (every K/V a sampling row reads is checked): a proposer offers the
fake model's own continuation, corrupted at a random place or cut short, or nothing; the
executor verifies proposals as the runner does (the accepted ones, then the model's token).
Steps are planned ahead of one in flight at random wherever the actor may (no proposals in
flight; a request at its fan-out sits the plan out), whether or not a sequence it samples
would have proposed next (the actor waits for those, a policy choice; planning ahead anyway
must stay exact). Every request
must get its output alone, under memory pressure, swaps, aborts, the batch-size limit and the
back-off that async scheduling aligns to the plan count."""

from __future__ import annotations

import itertools
import random
from collections import deque

import hypothesis.strategies as st
from hypothesis import event, given

from asyncpaged.core import BlockPool
from asyncpaged.core.block_table import LATE_TOKEN
from asyncpaged.core.request import Request, Sequence
from asyncpaged.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from asyncpaged.core.scheduler_plan import back_off, next_proposals
from asyncpaged.core.txn import apply_txn, snapshot
from tests.core.test_scheduler_property import (
    BS,
    VOCAB,
    FakeWorld,
    between_steps,
    next_token,
    reference_output,
    request_specs,
)

Sampled = dict[int, list[int]]


def execute(
    world: FakeWorld, out: SchedulerOutput, requests: dict[str, Request], late: dict[int, int]
) -> Sampled:
    """The fake runner: K/V for every slot the step hands out (a late token takes what the
    step before sampled), then per sampling row the model's token, or for a row with
    proposals the accepted ones and the model's token after them."""
    world.copy_blocks(world.device, world.device, out.copy_on_write)
    for plan in (*out.swap_outs, *out.swap_ins):
        world.swaps[plan.swap_id] = (plan.direction, plan.block_mapping)
    contexts: dict[int, list[int]] = {}
    for sch in out.seqs:
        seq = next(s for s in requests[sch.request_id].seqs if s.seq_id == sch.seq_id)
        if LATE_TOKEN in sch.token_ids:
            assert sch.token_ids == (LATE_TOKEN,) and sch.start_pos == len(seq.token_ids)
            assert not sch.num_draft
        new = [late[sch.seq_id] if t == LATE_TOKEN else t for t in sch.token_ids]
        context = contexts[sch.seq_id] = [*seq.token_ids[: sch.start_pos], *new]
        salt = requests[sch.request_id].cache_salt
        for i, slot in enumerate(sch.slot_mapping):
            pos = sch.start_pos + i
            world.device[slot] = (salt, tuple(context[: pos + 1]))
    sampled: Sampled = {}
    for sch in out.seqs:
        if not sch.samples:
            continue
        request = requests[sch.request_id]
        salt, context = request.cache_salt, contexts[sch.seq_id]
        for pos in range(len(context)):
            slot = sch.block_table[pos // BS] * BS + pos % BS
            want = (salt, tuple(context[: pos + 1]))
            assert world.device.get(slot) == want, f"{sch.request_id} reads bad KV at {pos}"
        kept = len(context) - sch.num_draft  # the context the proposals follow
        if sch.num_draft:
            tokens = []
            for j in range(kept, len(context) + 1):
                tokens.append(next_token(salt, context[:j]))
                if j == len(context) or tokens[-1] != context[j]:
                    break
            sampled[sch.seq_id] = tokens
            continue
        first = len(context) == request.seqs[0].num_prompt_tokens
        sampled[sch.seq_id] = [
            next_token(salt, context, draw if first else 0) for draw in range(sch.num_samples)
        ]
    return sampled


@given(data=st.data())
def test_speculation_planned_ahead_gives_each_request_its_output_alone(
    data: st.DataObject,
) -> None:
    num_device = data.draw(st.integers(6, 24), label="device blocks")
    num_host = data.draw(st.integers(0, 16), label="host blocks")
    config = SchedulerConfig(
        block_size=BS,
        num_device_blocks=num_device,
        max_num_seqs=data.draw(st.integers(1, 8)),
        max_num_batched_tokens=data.draw(st.integers(4, 48)),
        preemption_mode=data.draw(st.sampled_from(["recompute", "swap"]), label="mode"),
        spec_disable_by_batch_size=data.draw(st.sampled_from([None, None, 2]), label="limit"),
        spec_async=data.draw(st.booleans(), label="aligned back-off"),
    )
    pool = BlockPool(
        num_device, num_host, block_size=BS, enable_prefix_caching=data.draw(st.booleans())
    )
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="proposer seed"))
    salts: dict[int, str | None] = {}

    def propose(seq_id: int, token_ids: list[int], k: int) -> list[int]:
        """The model's continuation (1 to k tokens), a token wrong at a random place a third
        of the time; nothing a quarter of the time."""
        if rng.random() < 0.25:
            return []
        tokens = list(token_ids)
        for _ in range(rng.randint(1, k)):
            tokens.append(next_token(salts[seq_id], tokens))
        draft = tokens[len(token_ids) :]
        if rng.random() < 0.33:
            j = rng.randrange(len(draft))
            draft[j] = (draft[j] + 1) % VOCAB
        return draft

    sched = Scheduler(config, propose=propose)
    snap = snapshot(pool)
    world = FakeWorld()
    max_len = (num_device - 1) * BS
    ids, seq_ids = itertools.count(), itertools.count()
    every: dict[str, Request] = {}
    expected: dict[tuple[str, int], list[int]] = {}
    outputs: dict[tuple[str, int], list[int]] = {}
    aborted: set[str] = set()

    def add() -> None:
        prompt, salt, stop = data.draw(request_specs(max_len))
        num_samples = data.draw(st.sampled_from([1, 1, 1, 2]), label="samples")
        rid = f"r{next(ids)}"
        seq = Sequence(seq_id=next(seq_ids), index=0, token_ids=list(prompt),
                       num_prompt_tokens=len(prompt))  # fmt: skip
        fork_ids = tuple(next(seq_ids) for _ in range(num_samples - 1))
        for sid in (seq.seq_id, *fork_ids):
            salts[sid] = salt
        request = Request(request_id=rid, arrival=int(rid[1:]), seqs=[seq], stop=stop,
                          cache_salt=salt, num_samples=num_samples, fork_ids=fork_ids)  # fmt: skip
        request.num_speculative_tokens = data.draw(st.sampled_from([0, 1, 3, 3]), label="k")
        sched.add_request(request)
        every[rid] = request
        for i in range(num_samples):
            expected[(rid, i)] = reference_output(prompt, salt, stop, i)
            outputs[(rid, i)] = []

    for _ in range(data.draw(st.integers(1, 10), label="initial requests")):
        add()
    num_late = data.draw(st.integers(0, 6), label="late requests")
    in_flight: deque[tuple[SchedulerOutput, Sampled]] = deque()
    num_ahead = num_ahead_would_propose = 0
    stalled = False
    for _ in range(4000):
        idle = not (sched.has_unfinished or sched.has_swaps_in_flight or in_flight)
        if idle and not sched.has_pending_txn_work and num_late == 0:
            break
        last = in_flight[-1][0] if in_flight else None
        ahead = (
            last is not None
            and len(in_flight) < 2
            and sched.can_plan_ahead()
            and not sched.planned_cut
            and not stalled
            and not any(s.num_draft for s in last.seqs)
            and data.draw(st.booleans(), label="plan ahead")
        )
        if (
            in_flight
            and not ahead
            and sched.has_settle_work
            and data.draw(st.booleans(), label="settle")
        ):  # as the actor, while a step runs that the next is not planned ahead of
            snap = apply_txn(pool, sched.plan_settle()).snapshot
        elif in_flight and not ahead:
            out, sampled = in_flight.popleft()
            stalled = False
            for upd in sched.update(out, sampled):
                outputs[(upd.request_id, upd.completion)].extend(upd.new_token_ids)
        else:
            if last is not None and any(
                s.samples and s.request_id in sched.requests
                and next_proposals(sched, sched.requests[s.request_id],
                                   next(q for q in sched.requests[s.request_id].seqs
                                        if q.seq_id == s.seq_id)) > 0
                for s in last.seqs
            ):  # fmt: skip
                num_ahead_would_propose += 1  # (the actor would wait for the step)
            txn = sched.plan(snap, ahead=last)
            result = apply_txn(pool, txn)
            snap = result.snapshot
            out = sched.apply(txn, result)
            num_ahead += last is not None
            stalled = last is not None and not out.seqs
            late = {k: v[-1] for k, v in in_flight[-1][1].items()} if in_flight else {}
            sampled = execute(world, out, every, late)
            if out.seqs:
                in_flight.append((out, sampled))
        pool.check_invariants()
        num_late = between_steps(data, world, sched, add, num_late, aborted, abort_one_in=16)
    else:
        raise AssertionError("the scheduler stopped making progress")
    stats = sched.spec_stats
    event("planned ahead" if num_ahead else "never ahead")
    if num_ahead_would_propose:
        event("planned ahead of a sequence that would propose")
    if stats.num_draft_tokens:
        event("proposals accepted" if stats.num_accepted_tokens else "proposals, none kept")
    if sched.statistics().num_preemptions:
        event("preempted")
    for key, want in expected.items():
        got = outputs[key]
        if key[0] in aborted:
            assert got == want[: len(got)]
        else:
            assert got == want, key
    pool_stats = pool.statistics()
    assert pool_stats.num_seqs == 0
    assert pool_stats.device.used == pool_stats.device.in_flight == pool_stats.host.used == 0


def test_back_offs_end_on_shared_plans_with_async_scheduling() -> None:
    """Each wasted round doubles the pause (1 .. 16 decodes); with async scheduling it is
    stretched, by less than its length, to end on a plan whose count is a multiple of its
    length, so the sequences backing off propose on the same steps."""
    for spec_async in (False, True):
        sched = Scheduler(SchedulerConfig(spec_async=spec_async))
        for next_plan in range(50):
            seq = Sequence(seq_id=0, index=0, token_ids=[1, 2], num_prompt_tokens=1)
            for want in (1, 2, 4, 8, 16, 16):
                back_off(sched, seq, next_plan)
                assert seq.spec_backoff == want
                if spec_async:  # it proposes at plan next_plan + spec_skip
                    assert want <= seq.spec_skip < 2 * want
                    assert (next_plan + seq.spec_skip) % want == 0
                else:
                    assert seq.spec_skip == want
