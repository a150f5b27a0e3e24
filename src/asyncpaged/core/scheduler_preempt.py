"""Preemption on the scheduler's side: the priority policy's claim (a waiting request that
outranks running groups claims their seats and blocks; the allocator picks the victims, see
core/policy.py and core/txn.py), and settling a preemption the allocator made (the victim
moves to ``swapped``, or back to ``waiting`` to be recomputed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncpaged.core.policy import Room, num_outranked
from asyncpaged.core.request import Request, RequestStatus
from asyncpaged.core.scheduler_types import PlanBudget, insort
from asyncpaged.core.txn import Claim

if TYPE_CHECKING:
    from asyncpaged.core.scheduler import Scheduler


def claim_for_priority(sched: Scheduler, plan: PlanBudget) -> None:
    """Priority policy: age the waiting and swapped requests; if the best waiting request
    lacks seats or blocks (estimated without prefix-cache hits), claim the room of the
    running groups it outranks (``plan.claim``: the allocator preempts the fewest of them
    that make room, exactly, or none; core/policy.py's rule)."""
    policy, cfg = sched.policy, sched.config
    policy.age(sched.waiting)
    policy.age(sched.swapped)
    if not sched.waiting or not sched.running:
        return
    best = sched.waiting[0]
    if sched.swapped and (
        sched.swapped[0].queue_key < best.queue_key
        or any(r.status is RequestStatus.SWAPPING_OUT for r in sched.swapped)
    ):
        return  # a better swapped request comes first; or blocks are still coming back
    seqs = best.live_seqs
    chunk = max(1, plan.budget_left // len(seqs))
    bs = cfg.block_size
    need = Room(
        seats=len(seqs),
        blocks=sum(-(-min(len(s.token_ids), chunk) // bs) for s in seqs) + sched._watermark,
    )
    seats = cfg.max_num_seqs - sum(len(r.live_seqs) for r in sched.running)
    if seats >= need.seats and plan.free >= need.blocks:
        return
    outranked = num_outranked(policy, best, sched.running)
    if outranked:
        plan.claim = Claim(num_victims=outranked, seats=need.seats - seats, blocks=need.blocks)


def settle_preemption(sched: Scheduler, request: Request, swapped: bool) -> None:
    """The allocator preempted ``request`` (all its sequences): swapped out, or freed to be
    recomputed."""
    sched.running.remove(request)
    request.num_preemptions += 1
    sched.num_preemptions += 1
    if swapped:
        request.status = RequestStatus.SWAPPING_OUT
        insort(sched.swapped, request)
        sched.num_swap_outs += 1
        return
    for seq in request.live_seqs:  # the allocator freed them
        seq.num_computed_tokens = 0
        seq.has_blocks = False
    request.status = RequestStatus.WAITING
    insort(sched.waiting, request)
    sched.num_recomputes += 1
