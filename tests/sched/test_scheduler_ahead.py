"""Async scheduling in the core: steps planned while the one before is in flight (``plan(ahead=)``)
against the fake executor of ``test_scheduler_property``, which checks every K/V a sampling row
reads. A row whose input is a placeholder gets the token the step before sampled, as the runner
does; a request's output must equal the same request run alone, whichever steps were planned ahead,
under memory pressure (preemption then waits for the step in flight), priorities (a priority
preemption waits too), swaps, aborts and stop tokens that make a planned-ahead row compute for
nothing, a fake grammar's forced tokens (jump-forward), which discard a sample already in flight,
and parallel sampling (a request at its fork sits a plan ahead out, the next plan, ahead too, forks
its sequences; then each of them decodes a placeholder), and speculative decoding: a proposer offers
the fake model's own continuation, corrupted at a random place or cut short, or nothing, and the
executor verifies proposals as the runner does (the accepted ones, then the model's token). Steps
are planned ahead at random wherever the actor may (not ahead of proposals in flight), whether or
not a sequence would have proposed next (the actor waits for those, a policy choice; planning ahead
anyway must stay exact), under the batch-size limit and the back-off that async scheduling aligns to
the plan count."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import deque

import hypothesis.strategies as st
from hypothesis import event, given

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
from asyncpaged.kv.txn import apply_txn, snapshot
from asyncpaged.sched.request import Request, Sequence, StopCriteria
from asyncpaged.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.sched.rows import rows_of
from tests.sched.test_scheduler_property import (
    BS,
    VOCAB,
    FakeWorld,
    between_steps,
    next_token,
    reference_output,
    request_specs,
)

Sampled = dict[int, list[int]]


def forced_after(salt: str | None, tokens: list[int]) -> list[int]:
    """The fake grammar: the tokens it forces after ``tokens`` (1-3 of them, a third of the
    time; none otherwise)."""
    digest = hashlib.sha256(repr(("forced", salt, tuple(tokens))).encode()).digest()
    return [d % VOCAB for d in digest[1 : 2 + digest[0] % 3]] if digest[0] % 3 == 0 else []


def reference_forced(
    prompt: list[int], salt: str | None, stop: StopCriteria, index: int = 0
) -> list[int]:
    """Sequence ``index`` of the request run alone with the fake grammar: after each sampled
    token, the forced ones, under the same stop rules token by token."""
    tokens: list[int] = list(prompt)
    out: list[int] = []

    def stops(tok: int) -> bool:
        eos = len(out) >= stop.min_tokens and tok in stop.eos_token_ids and not stop.ignore_eos
        return eos or len(out) >= stop.max_tokens

    while True:
        tok = next_token(salt, tokens, index if not out else 0)
        tokens.append(tok)
        out.append(tok)
        if stops(tok):
            return out
        for tok in forced_after(salt, tokens):
            tokens.append(tok)
            out.append(tok)
            if stops(tok):
                return out


def execute(
    world: FakeWorld, out: SchedulerOutput, requests: dict[str, Request], late: dict[int, int]
) -> Sampled:
    """The fake runner: K/V for every slot the step hands out (a placeholder takes what the
    step before sampled), then per sampling row the model's token, or for a row with
    proposals the accepted ones and the model's token after them."""
    world.copy_blocks(world.device, world.device, out.copy_on_write)
    for plan in (*out.swap_outs, *out.swap_ins):
        world.swaps[plan.swap_id] = (plan.direction, plan.block_mapping)
    contexts: dict[int, list[int]] = {}
    for sch in out.seqs:
        seq = next(s for s in requests[sch.request_id].seqs if s.seq_id == sch.seq_id)
        if PLACEHOLDER_TOKEN in sch.token_ids:
            assert sch.token_ids == (PLACEHOLDER_TOKEN,) and sch.start_pos == len(seq.token_ids)
            assert not sch.num_draft
        new = [late[sch.seq_id] if t == PLACEHOLDER_TOKEN else t for t in sch.token_ids]
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
        # (a sampling row ends where its sequence does, with the token in flight, proposals)
        seq = next(s for s in request.seqs if s.seq_id == sch.seq_id)
        late_row = sch.token_ids[0] == PLACEHOLDER_TOKEN
        assert len(context) == len(seq.token_ids) + late_row + sch.num_draft, sch
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
def test_planning_ahead_gives_each_request_its_output_alone(data: st.DataObject) -> None:
    num_device = data.draw(st.integers(6, 24), label="device blocks")
    num_host = data.draw(st.integers(0, 16), label="host blocks")
    config = SchedulerConfig(
        block_size=BS,
        num_device_blocks=num_device,
        max_num_seqs=data.draw(st.integers(1, 8)),
        max_num_batched_tokens=data.draw(st.integers(4, 48)),
        preemption_mode=data.draw(st.sampled_from(["recompute", "swap"]), label="mode"),
        rope_switch_len=data.draw(st.sampled_from([None, None, 9]), label="rope switch"),
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
        priority_aging_steps=data.draw(st.integers(1, 8), label="aging"),
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
    grammar = data.draw(st.booleans(), label="a grammar forces tokens")
    priority_policy = config.scheduling_policy == "priority"
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
        num_samples = data.draw(st.sampled_from([1, 1, 2, 3]), label="samples")
        rid = f"r{next(ids)}"
        seq = Sequence(seq_id=next(seq_ids), index=0, token_ids=list(prompt),
                       num_prompt_tokens=len(prompt))  # fmt: skip
        priority = data.draw(st.integers(-2, 2), label="priority") if priority_policy else 0
        fork_ids = tuple(next(seq_ids) for _ in range(num_samples - 1))
        for sid in (seq.seq_id, *fork_ids):
            salts[sid] = salt
        request = Request(request_id=rid, arrival=int(rid[1:]), seqs=[seq], stop=stop,
                          cache_salt=salt, priority=priority, num_samples=num_samples,
                          fork_ids=fork_ids)  # fmt: skip
        # (the engine speculates for no request with a grammar)
        request.num_speculative_tokens = (
            0 if grammar else data.draw(st.sampled_from([0, 0, 1, 3]), label="k")
        )
        sched.add_request(request)
        every[rid] = request
        reference = reference_forced if grammar else reference_output
        for i in range(num_samples):
            expected[(rid, i)] = reference(prompt, salt, stop, i)
            outputs[(rid, i)] = []

    for _ in range(data.draw(st.integers(1, 12), label="initial requests")):
        add()
    num_placeholders = data.draw(st.integers(0, 8), label="late requests")
    in_flight: deque[tuple[SchedulerOutput, Sampled]] = deque()  # executed, not yet updated
    num_ahead = num_vain = 0
    stalled = False  # a plan ahead ran nothing: wait for the step in flight (as the actor does)
    for _ in range(4000):
        idle = not (sched.has_unfinished or sched.has_swaps_in_flight or in_flight)
        if idle and not sched.has_pending_txn_work and num_placeholders == 0:
            break
        ahead = (
            bool(in_flight)
            and len(in_flight) < 2
            and sched.can_plan_ahead()
            and not sched.planned_cut
            and not stalled
            # (as the actor: not ahead of proposals, where the next rows start is unknown)
            and not any(s.num_draft for s in in_flight[-1][0].seqs)
            and data.draw(st.booleans(), label="plan ahead")
        )
        if (
            in_flight and not ahead and sched.can_flush and data.draw(st.booleans(), label="flush")
        ):  # as the actor, while a step runs that the next is not planned ahead of
            snap = apply_txn(pool, sched.plan_flush()).snapshot
        elif in_flight and not ahead:  # the oldest step's tokens come back
            out, sampled = in_flight.popleft()
            stalled = False
            live = {s.seq_id for r in sched.requests.values() for s in r.seqs}
            num_vain += sum(1 for s in out.seqs if s.samples and s.seq_id not in live)
            for upd in sched.update(out, rows_of(out, sampled)):
                key = (upd.request_id, upd.completion)
                outputs[key].extend(upd.new_token_ids)
                if grammar and upd.finish_reason is None:  # jump-forward, as the actor does
                    request = every[upd.request_id]
                    seq = next(s for s in request.seqs if s.seq_id == upd.seq_id)
                    forced = forced_after(request.cache_salt, seq.token_ids)
                    num_void = len(sched._discarded)
                    appended, _, _ = sched.append_forced(upd.request_id, upd.seq_id, forced)
                    outputs[key].extend(appended)
                    if len(sched._discarded) > num_void:
                        event("a sample in flight voided")
        else:
            txn = sched.plan(snap, ahead=in_flight[-1][0] if in_flight else None)
            if in_flight:  # (forks: a fork that sat the plan before out, see below)
                assert not (txn.victims or txn.swap_ins or txn.preemption)
                if txn.forks:
                    event("forks planned ahead")
            result = apply_txn(pool, txn)
            snap = result.snapshot
            out = sched.apply(txn, result)
            num_ahead += bool(in_flight)
            if any(s.token_ids[0] == PLACEHOLDER_TOKEN and len(every[s.request_id].seqs) > 1
                   for s in out.seqs):  # fmt: skip
                event("a fanned-out request decodes placeholders")
            stalled = bool(in_flight) and not out.seqs
            late = {k: v[0] for k, v in in_flight[-1][1].items()} if in_flight else {}
            sampled = execute(world, out, every, late)  # (the swaps it starts, if nothing else)
            if out.seqs:
                in_flight.append((out, sampled))
        pool.check_invariants()
        num_placeholders = between_steps(
            data, world, sched, add, num_placeholders, aborted, abort_one_in=16
        )
    else:
        raise AssertionError("the scheduler stopped making progress")
    event("planned ahead" if num_ahead else "never ahead")
    if sched.spec_stats.num_draft_tokens:
        event("proposals accepted" if sched.spec_stats.num_accepted_tokens else "none kept")
    if num_vain:
        event("a row computed and discarded")
    if sched.statistics().num_preemptions:
        event(f"preempted ({config.scheduling_policy})")
    for key, want in expected.items():
        got = outputs[key]
        if key[0] in aborted:
            assert got == want[: len(got)]
        else:
            assert got == want, key
    stats = pool.statistics()
    assert stats.num_seqs == 0
    assert stats.device.used == stats.device.in_flight == stats.host.used == 0


def test_back_offs_end_on_shared_plans_with_async_scheduling() -> None:
    """Each wasted round doubles the pause (1 .. 16 decodes); with async scheduling it is
    stretched, by less than its length, to end on a plan whose count is a multiple of its
    length, so the sequences backing off propose on the same steps."""
    for spec_async in (False, True):
        sched = Scheduler(SchedulerConfig(spec_async=spec_async))
        for next_plan in range(50):
            seq = Sequence(seq_id=0, index=0, token_ids=[1, 2], num_prompt_tokens=1)
            for want in (1, 2, 4, 8, 16, 16):
                sched.back_off(seq, next_plan)
                assert seq.spec_backoff == want
                if spec_async:  # it proposes at plan next_plan + spec_skip
                    assert want <= seq.spec_skip < 2 * want
                    assert (next_plan + seq.spec_skip) % want == 0
                else:
                    assert seq.spec_skip == want
