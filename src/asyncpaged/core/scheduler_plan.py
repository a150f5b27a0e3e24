"""Step planning from the queues: what the running requests append this step (prefill chunks,
decode tokens, speculative proposals), which swapped requests come back in, and which waiting
requests are offered for admission, all within the token, sequence and block budgets of a
:class:`PlanBudget`. Also the long-RoPE restart, which sends a running request back to waiting.

These are the :class:`~asyncpaged.core.scheduler.Scheduler`'s planning steps; each takes the
scheduler whose queues it reads (and, where said, changes)."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from asyncpaged.core.block_table import LATE_TOKEN
from asyncpaged.core.request import Request, RequestStatus, Sequence
from asyncpaged.core.scheduler_types import PlanBudget, SchedulerConfig, insort
from asyncpaged.core.txn import Admission, AllocateOp

if TYPE_CHECKING:
    from asyncpaged.core.scheduler import Scheduler

Chunks = list[tuple[Sequence, int]]  # (sequence, tokens to compute)
Drafts = dict[int, tuple[int, ...]]  # seq id -> speculative proposals


def plan_running(
    sched: Scheduler, plan: PlanBudget, shared: AbstractSet[int | str], frees: list[int]
) -> tuple[list[tuple[int, tuple[int, ...]]], list[int]]:
    """The running requests' appends in queue order, within the budgets: (seq id, tokens)
    per sequence, and the number of them per request. Where the blocks run short
    (``plan.short``) the allocator preempts; the needs here are upper bounds (a tail
    counted as shared may not be). Records the appends in ``sched._planned``."""
    appends: list[tuple[int, tuple[int, ...]]] = []  # (seq id, tokens)
    sizes: list[int] = []
    planned = sched._planned = []
    running = sched.running
    i = 0
    pending = plan.pending
    void = sched._void
    while i < len(running):
        request = running[i]
        if pending is None:
            late = False
        elif len(request.seqs) == 1:  # (a void sample in flight: the forced tokens are known)
            sid = request.seqs[0].seq_id
            late = sid in pending and not (void and sid in void)
        else:  # parallel sampling: each sequence whose token is in flight (_late_step_of)
            late = any(s.seq_id in pending for s in request.seqs)
        step = (
            _late_step_of(sched, request, plan, shared)
            if late
            else _step_of(sched, request, plan, shared)
        )
        if step is None:
            break  # token or sequence budget spent
        chunks, drafts, need = step
        if not chunks:
            i += 1  # nothing to compute (beams that reported wait for their siblings)
            continue
        if _outgrows_short_rope(sched.config, request, chunks):
            behind = _still_short(sched.config, chunks)
            if behind:  # (its sequences apart, by kept proposals: these catch up first)
                chunks = behind
                drafts, need = _proposals_and_need(sched, chunks, drafts, shared)
            elif pending is not None:  # (a request in flight keeps its blocks until it returns)
                plan.cut = True
                break
            else:
                restart_long_rope(sched, request, frees)
                continue  # the next request moved into index i
        if need > plan.free:
            if pending is not None:  # no preemption with a step in flight: plan the rest later
                plan.cut = True
                break
            plan.short = True
        plan.free -= need
        sizes.append(len(chunks))
        for seq, n in chunks:
            start = seq.num_computed_tokens
            draft = drafts.get(seq.seq_id, ()) if drafts else ()
            # (a late row's input is the token in flight: one past the sequence's tokens)
            at_end = late and start == len(seq.token_ids)
            tokens = (LATE_TOKEN,) if at_end else (*seq.token_ids[start : start + n], *draft)
            appends.append((seq.seq_id, tokens))
            planned.append((request, seq, len(draft)))
            plan.budget_left -= len(tokens)
            plan.seats_left -= 1
        i += 1
    return appends, sizes


def _late_step_of(
    sched: Scheduler, request: Request, plan: PlanBudget, shared: AbstractSet[int | str]
) -> tuple[Chunks, Drafts, int] | None:
    """Planning ahead (async scheduling): the decodes of a request's sequences whose next
    tokens the step in flight is sampling, each as a late token; no chunk for one that its
    token ends by its length for sure (an end by a stop token is known only then: the row is
    computed in vain), nor for a request whose fan-out is in flight (it sits this step out:
    its other sequences exist once that step is back, and its next plan forks them). A
    parallel-sampling request with a sequence that has known tokens to compute first (a
    grammar's forced ones after a void sample) waits for the step in flight: no chunks now."""
    stop = request.stop
    bs = sched.config.block_size
    if len(request.seqs) == 1:  # the common case, without the list building below
        if plan.seats_left < 1 or plan.budget_left < 1:
            return None
        seq = request.seqs[0]
        if request.num_samples > 1 and not seq.num_generated:
            return [], {}, 0  # its fan-out is in flight: its sequences exist once it is back
        num_tokens = len(seq.token_ids) + 1  # with the token in flight
        if num_tokens - seq.num_prompt_tokens >= stop.max_tokens or (
            stop.max_model_len is not None and num_tokens >= stop.max_model_len
        ):
            return [], {}, 0
        if seq.spec_skip:  # a decode without proposals: one step less of its back-off
            seq.spec_skip -= 1
        # (num_computed_tokens == len(token_ids): the token in flight comes next)
        return [(seq, 1)], {}, blocks_to_append(seq, 1, seq.seq_id in shared, bs)
    live = request.live_seqs
    if plan.seats_left < len(live) or plan.budget_left < len(live):
        return None
    if any(s.num_computed_tokens != len(s.token_ids) for s in live):
        return [], {}, 0
    chunks: Chunks = []
    need = 0
    for seq in live:  # (num_computed_tokens == len(token_ids): the token in flight is next)
        num_tokens = len(seq.token_ids) + 1  # with the token in flight
        if num_tokens - seq.num_prompt_tokens >= stop.max_tokens or (
            stop.max_model_len is not None and num_tokens >= stop.max_model_len
        ):
            continue
        if seq.spec_skip:
            seq.spec_skip -= 1
        chunks.append((seq, 1))
        need += blocks_to_append(seq, 1, seq.seq_id in shared, bs)
    return chunks, {}, need


def _step_of(
    sched: Scheduler, request: Request, plan: PlanBudget, shared: AbstractSet[int | str]
) -> tuple[Chunks, Drafts, int] | None:
    """A running request's chunks, proposals and block need this step; None if the budgets
    are spent, no chunks if it has nothing to compute."""
    seqs = request.seqs
    if len(seqs) == 1 and seqs[0].finish_reason is None:  # the common case, inline
        if plan.seats_left < 1 or plan.budget_left < 1:
            return None
        seq = seqs[0]
        have = seq.num_computed_tokens
        n = min(len(seq.token_ids) - have, plan.budget_left)
        if not n:
            return [], {}, 0
        chunks = [(seq, n)]
        drafts = (
            plan_drafts(sched, request, chunks, plan.budget_left)
            if request.num_speculative_tokens
            else {}
        )
        if drafts:
            n += len(drafts[seq.seq_id])
        bs = sched.config.block_size
        return chunks, drafts, -(-(have + n) // bs) - -(-have // bs) + (seq.seq_id in shared)
    some = chunks_of(request, plan)
    if some is None:
        return None
    if not some:
        return [], {}, 0
    drafts = plan_drafts(sched, request, some, plan.budget_left)
    bs = sched.config.block_size
    need = sum(
        blocks_to_append(s, n + len(drafts.get(s.seq_id, ())), s.seq_id in shared, bs)
        for s, n in some
    )
    return some, drafts, need


def plan_drafts(sched: Scheduler, request: Request, chunks: Chunks, budget: int) -> Drafts:
    """Speculative decoding: proposals for the decodes among ``chunks`` (sequences whose
    one new token is their last), within the token budget and never past ``max_tokens``
    or ``max_model_len`` (a step emits at most its proposals + 1 tokens), nor, for a request
    in longrope's short regime, past the switch (a verification row there would rotate with
    the short factors where transformers uses the long ones: the next decode restarts it)."""
    k = request.num_speculative_tokens
    propose = sched._propose
    if not k or propose is None:
        return {}
    limit_batch = sched.config.spec_disable_by_batch_size
    if limit_batch is not None and len(sched.running) > limit_batch:
        return {}
    budget -= sum(n for _, n in chunks)
    stop = request.stop
    switch = sched.config.rope_switch_len
    drafts: Drafts = {}
    fans_out = request.num_samples > 1 and len(request.seqs) == 1
    for seq, n in chunks:
        if n != 1 or seq.num_uncomputed != 1 or budget <= 0:
            continue
        if fans_out and not seq.num_generated:  # the prompt's end draws n: no proposals
            continue
        if seq.spec_skip:  # backing off after rounds that kept nothing
            seq.spec_skip -= 1
            continue
        room = stop.max_tokens - seq.num_generated - 1
        if stop.max_model_len is not None:
            room = min(room, stop.max_model_len - len(seq.token_ids) - 1)
        if switch is not None and not request.long_rope:
            room = min(room, switch - len(seq.token_ids))  # (the row's context stays short)
        limit = min(k, budget, room)
        if limit <= 0:
            continue
        draft = tuple(propose(seq.seq_id, seq.token_ids, limit))[:limit]
        if draft:
            drafts[seq.seq_id] = draft
            budget -= len(draft)
        elif sched.config.spec_async:  # found nothing: waiting for the token was in vain
            back_off(sched, seq, sched.num_plans + 1)
    return drafts


def back_off(sched: Scheduler, seq: Sequence, next_plan: int) -> None:
    """Pause a sequence's proposals after a round that kept none (with async scheduling,
    also one whose proposer found none): each such round in a row doubles the pause, 1, 2, 4
    .. 16 of its decodes; ``next_plan``: the count of the next plan. With async scheduling the
    pause is stretched (by less than its length) to end on a plan whose count is a multiple of
    its length, so backed-off sequences propose on the same steps and the rest go ahead."""
    pause = seq.spec_backoff = min(16, 2 * seq.spec_backoff or 1)
    if sched.config.spec_async:
        pause += -(next_plan + pause) % pause
    seq.spec_skip = pause


def next_proposals(sched: Scheduler, request: Request, seq: Sequence) -> int:
    """How many proposals the decode after ``seq``'s token in flight may carry (the draft
    model draws that many at the end of the step): none while it backs off, above
    ``spec_disable_by_batch_size`` running requests, or near ``max_tokens`` or
    ``max_model_len``, or, in longrope's short regime, the switch (see :func:`plan_drafts`)."""
    k = request.num_speculative_tokens
    if not k or seq.spec_skip or sched._propose is None:
        return 0
    limit = sched.config.spec_disable_by_batch_size
    if limit is not None and len(sched.running) > limit:
        return 0
    stop = request.stop
    room = stop.max_tokens - seq.num_generated - 2
    if stop.max_model_len is not None:
        room = min(room, stop.max_model_len - len(seq.token_ids) - 2)
    switch = sched.config.rope_switch_len
    if switch is not None and not request.long_rope:
        room = min(room, switch - len(seq.token_ids) - 1)
    return max(0, min(k, room))


def chunks_of(request: Request, plan: PlanBudget) -> Chunks | None:
    """(sequence, tokens to compute) for a running request, or None if over budget; empty when
    none of its sequences has anything to compute this step."""
    if len(request.seqs) == 1:  # the common case, without the list building below
        seq = request.seqs[0]
        if seq.finish_reason is None:
            if plan.seats_left < 1 or plan.budget_left < 1:
                return None
            todo = len(seq.token_ids) - seq.num_computed_tokens
            return [(seq, min(todo, plan.budget_left))] if todo else []
    seqs = request.live_seqs
    if plan.seats_left < len(seqs) or plan.budget_left < len(seqs):
        return None
    share = plan.budget_left // len(seqs)
    # A beam that reported waits (nothing to compute) until its siblings have too.
    return [(s, min(s.num_uncomputed, share)) for s in seqs if s.num_uncomputed]


def blocks_to_append(seq: Sequence, n: int, shared_tail: bool, block_size: int) -> int:
    """New device blocks ``seq`` needs for ``n`` more tokens (one more for a shared tail)."""
    have = seq.num_computed_tokens
    return -(-(have + n) // block_size) - -(-have // block_size) + (1 if shared_tail else 0)


def _outgrows_short_rope(config: SchedulerConfig, request: Request, chunks: Chunks) -> bool:
    switch = config.rope_switch_len
    return (
        switch is not None
        and not request.long_rope
        and any(s.num_computed_tokens + n > switch for s, n in chunks)
    )


def _still_short(config: SchedulerConfig, chunks: Chunks) -> Chunks:
    """The chunks that stay within longrope's short regime. A parallel-sampling request whose
    sequences speculation has set apart computes these alone while the others wait at the
    switch, so that each token is sampled in the regime its own sequence's length picks (as
    without speculation, where they cross together); it restarts once all would cross."""
    switch = config.rope_switch_len
    assert switch is not None
    return [(s, n) for s, n in chunks if s.num_computed_tokens + n <= switch]


def _proposals_and_need(
    sched: Scheduler, chunks: Chunks, drafts: Drafts, shared: AbstractSet[int | str]
) -> tuple[Drafts, int]:
    """The proposals of ``chunks``' sequences among ``drafts``, and the chunks' block need."""
    bs = sched.config.block_size
    kept = {s.seq_id: drafts[s.seq_id] for s, _ in chunks if s.seq_id in drafts}
    need = sum(
        blocks_to_append(s, n + len(kept.get(s.seq_id, ())), s.seq_id in shared, bs)
        for s, n in chunks
    )
    return kept, need


def restart_long_rope(sched: Scheduler, request: Request, frees: list[int]) -> None:
    """Recompute a request from its first token in the long RoPE regime: its cached K/V
    were rotated with the short factors. Frees land before admissions in the transaction,
    so it may be admitted again in this very step (under its long-regime cache key)."""
    sched.running.remove(request)
    request.long_rope = True
    frees.extend(s.seq_id for s in request.live_seqs)
    for seq in request.live_seqs:
        seq.num_computed_tokens = 0
        seq.has_blocks = False
    request.status = RequestStatus.WAITING
    insort(sched.waiting, request)
    sched.num_rope_restarts += 1


def plan_in_rank_order(
    sched: Scheduler, plan: PlanBudget
) -> tuple[list[tuple[int, ...]], list[Admission]]:
    """Priority policy: swapped requests ranked above the best waiting one come back first;
    the waiting ones are offered once every one of those is coming back."""
    limit = sched.waiting[0].queue_key if sched.waiting else None
    swap_ins = plan_swap_ins(sched, plan, before=limit)
    coming = {s for group in swap_ins for s in group}
    if limit is None or any(
        r.status is not RequestStatus.SWAPPING_IN
        and r.live_seqs[0].seq_id not in coming
        and r.queue_key < limit
        for r in sched.swapped
    ):
        return swap_ins, []
    return swap_ins, plan_admissions(sched.waiting, plan)


def plan_swap_ins(
    sched: Scheduler, plan: PlanBudget, before: tuple[int, int] | None = None
) -> list[tuple[int, ...]]:
    """Swapped requests back in, in queue order (those ranked before ``before``)."""
    bs = sched.config.block_size
    groups: list[tuple[int, ...]] = []
    for request in sched.swapped:
        if before is not None and request.queue_key >= before:
            break
        if request.status is not RequestStatus.SWAPPED:
            continue
        assert request.swap_id is None
        need = request.num_swap_blocks
        # Room for the group's next step too (a new or copied block per sequence, more for
        # tokens a grammar forced), or it would preempt itself and swap out and in forever.
        step = sum(max(1, blocks_to_append(s, s.num_uncomputed, False, bs))
                   for s in request.live_seqs)  # fmt: skip
        if need + step + sched._watermark > plan.free:
            break  # first come, first served: no one overtakes
        plan.free -= need
        groups.append(tuple(s.seq_id for s in request.live_seqs))
    return groups


def plan_admissions(waiting: list[Request], plan: PlanBudget) -> list[Admission]:
    """Waiting requests offered for admission, in queue order, within the budgets."""
    admissions: list[Admission] = []
    for request in waiting:
        seqs = request.live_seqs
        if plan.seats_left < len(seqs) or plan.budget_left < len(seqs):
            break
        chunk = plan.budget_left // len(seqs)
        ops = tuple(
            AllocateOp(seq_id=s.seq_id, token_ids=tuple(s.token_ids), max_new_tokens=chunk,
                       extra_key=request.cache_key, read_cache=request.read_prefix_cache)
            for s in seqs
        )  # fmt: skip
        admissions.append(Admission(request_id=request.request_id, ops=ops))
        # Budget as if nothing were cached; the allocator's grants tell the real count.
        plan.budget_left -= sum(min(chunk, len(s.token_ids)) for s in seqs)
        plan.seats_left -= len(seqs)
    return admissions
