"""Queue order and preemption victims: first come first served, or priorities with aging.

The scheduler core keeps its three queues (waiting, running, swapped) sorted by
:attr:`Request.queue_key`, ``(effective priority, arrival)``, and takes preemption victims from
the end of ``running``. Under ``"fcfs"`` every effective priority is 0, so that is arrival order
and the newest request is the victim (the paper's policy). Under ``"priority"`` (vLLM's
convention: lower values first, FCFS among equals):

* **Aging bounds starvation.** Every plan a request spends waiting or swapped counts; its
  effective priority is ``priority - num_wait_steps // aging_steps``. A request that waited
  ``(p - q) * aging_steps`` plans ranks with priority-``q`` newcomers, and being older it then
  goes first. While running it keeps the effective priority it had (no credit is lost, none
  earned).
* **Preemption for a waiting request.** When the best waiting request cannot be admitted for
  lack of room for sequences (``max_num_seqs``) or device blocks, the lowest-ranked running groups
  that it strictly outranks are preempted, whole (swap or recompute, as configured), the fewest
  that make room, but only if preempting them makes room; otherwise none are. The scheduler
  counts the outranked groups (:func:`num_outranked`) and the allocator, which knows exactly
  what preempting them frees, picks (``kv/txn.py``'s ``PriorityPreemption``).
* **Swapped requests come back in rank order** with the waiting ones: a waiting request is
  offered for admission once every swapped request ranked above it is coming back.
"""

from __future__ import annotations

from collections.abc import Sequence as SeqOf
from dataclasses import dataclass
from typing import Literal

from asyncpaged.errors import InvalidRequestError
from asyncpaged.sched.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
DEFAULT_AGING_STEPS = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class Room:
    """What admitting a request needs, and what the step has: sequences and blocks."""

    num_seqs: int
    blocks: int


class QueuePolicy:
    """Ranks requests for the scheduler's queues.

    Invariants: under ``"fcfs"`` no request's ``effective_priority`` ever leaves 0, so queue
    order is arrival order; under ``"priority"`` ``effective_priority == priority -
    num_wait_steps // aging_steps`` for every request that is waiting or swapped, and
    ``num_wait_steps`` never decreases.
    """

    def __init__(
        self, kind: SchedulingPolicy = "fcfs", aging_steps: int = DEFAULT_AGING_STEPS
    ) -> None:
        if kind not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {kind!r}.")
        if aging_steps < 1:
            raise ValueError(f"priority_aging_steps must be at least 1, got {aging_steps}.")
        self.kind = kind
        self.aging_steps = aging_steps

    @property
    def is_priority(self) -> bool:
        return self.kind == "priority"

    def on_add(self, request: Request) -> None:
        """A new request: its effective priority starts at its priority."""
        if self.is_priority:
            request.effective_priority = request.priority - request.num_wait_steps // (
                self.aging_steps
            )

    def age(self, queue: list[Request]) -> None:
        """One more plan spent in ``queue`` (waiting or swapped): age and re-sort it."""
        if not self.is_priority or not queue:
            return
        aging = self.aging_steps
        for request in queue:
            request.num_wait_steps += 1
            request.effective_priority = request.priority - request.num_wait_steps // aging
        queue.sort(key=_queue_key)

    def outranks(self, a: Request, b: Request) -> bool:
        """``a`` may preempt ``b``: a strictly better effective priority (never under FCFS)."""
        return self.is_priority and a.effective_priority < b.effective_priority


def num_outranked(policy: QueuePolicy, candidate: Request, running: SeqOf[Request]) -> int:
    """How many running groups, from the end of ``running`` (queue order: the victims' end),
    ``candidate`` strictly outranks: the ones a priority preemption may take."""
    n = 0
    for victim in reversed(running):
        if not policy.outranks(candidate, victim):
            break
        n += 1
    return n


def _queue_key(request: Request) -> tuple[int, int]:
    return request.queue_key


def check_priority(priority: object, policy: SchedulingPolicy) -> int:
    """A request's ``priority`` as the engine takes it: any int under ``"priority"``; 0 only
    under ``"fcfs"`` (vLLM's rule). Raises ``InvalidRequestError`` otherwise (bools included)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an int, got {type(priority).__name__}.")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(
            f"Got priority {priority} but priority scheduling is not enabled "
            "(EngineConfig(scheduling_policy='priority'))."
        )
    return priority


__all__ = [
    "DEFAULT_AGING_STEPS",
    "QueuePolicy",
    "Room",
    "SchedulingPolicy",
    "check_priority",
    "num_outranked",
]
