"""Settling the allocator's result on the scheduler's side: the granted appends become the
step's rows, the preemptions the allocator made are settled (core/scheduler_preempt.py), the
swaps it started are recorded, and the admitted requests start running; all of it built into
the :class:`SchedulerOutput` the executor runs.

These are the :class:`~asyncpaged.core.scheduler.Scheduler`'s apply steps; each takes the
scheduler whose queues and request state it changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncpaged.core.block_table import LATE_TOKEN, SwapPlan
from asyncpaged.core.request import Request, RequestStatus, Sequence
from asyncpaged.core.scheduler_preempt import settle_preemption
from asyncpaged.core.scheduler_types import ScheduledSeq, SchedulerOutput, insort, new_tuple
from asyncpaged.core.txn import StepTxn, TxnResult

if TYPE_CHECKING:
    from asyncpaged.core.scheduler import Scheduler


def apply_result(sched: Scheduler, txn: StepTxn, result: TxnResult) -> SchedulerOutput:
    """:meth:`Scheduler.apply`: see there."""
    seqs: list[ScheduledSeq] = []
    num_tokens = 0
    # The allocator grants a prefix of the planned appends (all of them without pressure).
    num_appended = len(result.append_slots)
    appended = zip(
        sched._planned[:num_appended], txn.append_token_ids, result.append_slots,
        result.append_tables, strict=False,
    )  # fmt: skip
    for (request, seq, num_draft), tokens, slots, table in appended:
        num_tokens += _schedule(
            sched, seqs, request, seq, seq.num_computed_tokens, tokens, slots, table, num_draft
        )
    preempted = sched._victims[: len(result.preempted)]
    for request, swapped in zip(preempted, result.preempted, strict=True):
        settle_preemption(sched, request, swapped)
    _settle_swaps(sched, result)
    for request_id, grants in result.admitted:
        request = sched.requests[request_id]
        sched.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        insort(sched.running, request)
        by_id = {s.seq_id: s for s in request.live_seqs}
        for grant in grants:
            seq = by_id[grant.seq_id]
            request.num_cached_tokens = max(request.num_cached_tokens, grant.num_cached_tokens)
            start = grant.num_cached_tokens
            tokens = tuple(seq.token_ids[start : start + len(grant.slot_mapping)])
            num_tokens += _schedule(
                sched, seqs, request, seq, start, tokens, grant.slot_mapping, grant.block_table
            )
    return SchedulerOutput(
        step_id=next(sched._step_ids),
        seqs=tuple(seqs),
        copy_on_write=result.copy_on_write,
        swap_outs=result.swap_outs,
        swap_ins=result.swap_ins,
        preempted=tuple(r.request_id for r in preempted),
        num_batched_tokens=num_tokens,
    )


def _settle_swaps(sched: Scheduler, result: TxnResult) -> None:
    """Record the swaps the allocator started: out (blocks mapped) and in."""
    for plan in result.swap_outs:
        request = _swap_owner(sched, plan)
        request.swap_id = plan.swap_id
        sched._swaps[plan.swap_id] = request
        request.num_swap_blocks = len(plan.block_mapping)
    for plan in result.swap_ins:
        request = _swap_owner(sched, plan)
        assert request.status is RequestStatus.SWAPPED
        request.status = RequestStatus.SWAPPING_IN
        sched.num_swap_ins += 1
        request.swap_id = plan.swap_id
        sched._swaps[plan.swap_id] = request


def _schedule(
    sched: Scheduler,
    out: list[ScheduledSeq],
    request: Request,
    seq: Sequence,
    start: int,
    tokens: tuple[int, ...],
    slots: tuple[int, ...],
    table: tuple[int, ...],
    num_draft: int = 0,
) -> int:
    """Append the row of ``seq`` computing ``tokens`` (positions from ``start``) into
    ``slots`` to ``out``; returns its number of tokens."""
    n = len(slots)
    # Proposals are computed but not yet the sequence's: update() counts the kept ones.
    seq.num_computed_tokens = start + n - num_draft
    seq.has_blocks = True
    if tokens[0] == LATE_TOKEN:  # the token the step in flight samples: one past the end
        sched._late.add(seq.seq_id)
    # (a late token's row computes one past the end: the step in flight samples its input)
    samples = seq.num_computed_tokens >= len(seq.token_ids)
    fan_out = samples and len(request.seqs) == 1 and seq.num_generated == 0
    row = (
        request.request_id, seq.seq_id, tokens, start, slots, table, samples,
        request.num_samples if fan_out else 1,
        sched._min_rope_len if request.long_rope else 0, num_draft,
    )  # fmt: skip
    out.append(new_tuple(ScheduledSeq, row))
    return n


def _swap_owner(sched: Scheduler, plan: SwapPlan) -> Request:
    seq_id = plan.seq_ids[0]
    return next(r for r in sched.swapped if any(s.seq_id == seq_id for s in r.seqs))
