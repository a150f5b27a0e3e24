"""Iteration-level scheduling: FCFS or priorities (core/policy.py); pure Python, no pool.

The scheduler owns the queues and request state; the allocator owns the block pool. One step::

    txn = scheduler.plan(snapshot)           # decisions against the allocator's exact snapshot
    result = apply_txn(pool, txn)            # the allocator (its own actor in the engine)
    output = scheduler.apply(txn, result)    # admissions settled, the step's plan built
    ... the executor runs output (copy-on-write first), swaps run beside it ...
    updates = scheduler.update(output, sampled_tokens)

The plan, in order:

1. running requests, oldest first: a decode token per sequence, or the next prefill chunk. A
   request whose blocks do not fit preempts the newest running request (all its sequences: by
   swap to the host pool, or by recompute) until it fits, or waits a step when blocks being
   swapped out will free enough. How far that goes only the pool knows exactly, so when the
   plan's needs exceed the snapshot's free blocks the transaction carries the running groups
   as victims and the allocator preempts (core/txn.py); :meth:`Scheduler.apply` settles them;
2. if the needs fit: swapped requests come back in, oldest first;
3. if the needs fit and nothing is swapped: waiting requests are offered for admission, oldest
   first, within the token and sequence budgets (chunked prefill); the allocator admits a prefix
   of them.

Finished and aborted sequences are freed, and completed swaps confirmed, in the next
transaction.

This module owns the :class:`Scheduler` (the queues, request state and the transaction's
pending work). Its parts: core/scheduler_types.py (config and output values),
core/scheduler_plan.py (what the running, swapped and waiting requests do in a step),
core/scheduler_preempt.py (priority claims, settling preemptions), core/scheduler_apply.py
(settling the allocator's result into a :class:`SchedulerOutput`: granted appends, swaps,
admissions) and core/scheduler_update.py (appending sampled tokens, stop rules, speculative
verification, fan-out, beam steps).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SeqOf

from asyncpaged.core.beam_search import Hypothesis
from asyncpaged.core.policy import QueuePolicy
from asyncpaged.core.request import Request, RequestStatus, Sequence
from asyncpaged.core.scheduler_apply import apply_result
from asyncpaged.core.scheduler_plan import (
    plan_admissions,
    plan_in_rank_order,
    plan_running,
    plan_swap_ins,
)
from asyncpaged.core.scheduler_preempt import claim_for_priority
from asyncpaged.core.scheduler_types import (
    PlanBudget,
    PreemptionMode,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStatistics,
    SeqUpdate,
    insort,
)
from asyncpaged.core.scheduler_update import append_forced, update_step
from asyncpaged.core.txn import Admission, PinOp, PoolSnapshot, StepTxn, TxnResult
from asyncpaged.spec_decode.stats import SpeculativeStats

__all__ = [
    "PreemptionMode",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStatistics",
    "SeqUpdate",
]


class Scheduler:
    """Iteration-level scheduling over request state, FCFS or by priority (``self.policy``).

    Invariants:

    * Every unfinished request is in exactly one of ``waiting``, ``running`` and ``swapped``,
      each sorted by arrival; finished requests are dropped at once.
    * Waiting requests hold no blocks (their frees may still be pending in the next
      transaction); the live sequences of a running request have device tables; those of a
      swapped request are on the host or in flight.
    * Preemption and swapping move whole requests (all live sequences together).
    * No request is admitted in a step that preempted, nor (FCFS) while another is swapped or
      (priority) while a swapped request ranked above it is not coming back.
    * Victims are always the newest (lowest-ranked) running requests; between :meth:`plan` and
      :meth:`apply` they stay in ``running``, and ``apply`` moves those the allocator took.
    * Queues are sorted by :attr:`Request.queue_key` (core/policy.py): arrival under FCFS.
    * Every mandatory operation of a planned transaction fits the snapshot it was planned on.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        new_seq_id: Callable[[], int] | None = None,
        propose: Callable[[int, list[int], int], SeqOf[int]] | None = None,
    ) -> None:
        """``propose(seq_id, token_ids, k)``: speculative decoding's proposer (at most ``k``
        tokens to follow sequence ``seq_id``'s ``token_ids``), asked for each decode of a
        request with ``num_speculative_tokens``."""
        self.config = config
        self._new_seq_id = new_seq_id or itertools.count(1 << 40).__next__
        self._propose = propose
        self.spec_stats = SpeculativeStats()
        # (seq id, tokens kept) of verified sequences: their rejected slots roll back next txn
        self._pending_truncates: list[tuple[int, int]] = []
        self.finished_beams: list[tuple[str, list[Hypothesis]]] = []  # drained by the caller
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._swaps: dict[int, Request | None] = {}  # swap id -> request (None: aborted)
        self._pending_frees: list[int] = []
        self._pending_completes: list[int] = []
        self._pending_forks: list[tuple[int, int]] = []
        self._swapped_back: set[int] = set()
        self._pending_pins: list[PinOp] = []
        self._pending_unpins: list[int] = []  # seqs back on device since the last snapshot
        # Async scheduling: sequences whose last appended slot holds a late token in the pool,
        # and (seq id, value) of those whose value came back, for the next transaction
        self._late: set[int] = set()
        self._pending_late: list[tuple[int, int]] = []
        # sequences whose sample in flight is void: a grammar forced the tokens after the
        # token before it (append_forced), so the next plan computes those instead
        self._void: set[int] = set()
        self.planned_cut = False  # the last plan, made ahead, stopped short (see plan)
        # rows planned ahead whose sample was not used: their request ended meanwhile, or
        # their sample was void
        self.num_rows_in_vain = 0
        self._step_ids = itertools.count()
        self.num_plans = 0  # plans made (speculative back-offs under async scheduling align to it)
        # the last plan's appends: (request, sequence, proposals appended after its tokens)
        self._planned: list[tuple[Request, Sequence, int]] = []
        self._victims: list[Request] = []  # the last plan's victims, newest first
        self._watermark = math.ceil(config.watermark * config.num_device_blocks)
        self._min_rope_len = (config.rope_switch_len or 0) + 1
        self.policy = QueuePolicy(config.scheduling_policy, config.priority_aging_steps)
        self.num_preemptions = self.num_swap_outs = self.num_swap_ins = 0
        self.num_recomputes = self.num_finished = self.num_aborted = 0
        self.num_rope_restarts = 0

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate id {request.request_id!r}"
        assert request.status is RequestStatus.WAITING
        switch = self.config.rope_switch_len
        if switch is not None and len(request.seqs[0].token_ids) > switch:
            request.long_rope = True  # long from the first token, as a one-shot prefill
        self.requests[request.request_id] = request
        self.policy.on_add(request)
        insort(self.waiting, request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request with reason "abort" wherever it is; its blocks are freed by the next
        transaction (a swap in flight keeps its blocks until the copy completes)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        self._finish(request)
        self.num_aborted += 1
        return request

    def complete_swap(self, swap_id: int) -> None:
        """A swap's copies are done: the request becomes swapped, or running again."""
        request = self._swaps.pop(swap_id)
        self._pending_completes.append(swap_id)
        if request is None:  # aborted while its blocks were being copied
            return
        request.swap_id = None
        if request.status is RequestStatus.SWAPPING_OUT:
            request.status = RequestStatus.SWAPPED
        else:
            assert request.status is RequestStatus.SWAPPING_IN
            self.swapped.remove(request)
            request.status = RequestStatus.RUNNING
            insort(self.running, request)
            self._swapped_back.update(s.seq_id for s in request.live_seqs)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_swaps_in_flight(self) -> bool:
        return bool(self._swaps)

    @property
    def has_pending_txn_work(self) -> bool:
        """Frees or swap confirmations wait for the next transaction."""
        return self.has_settle_work or bool(self._pending_forks or self._pending_truncates)

    @property
    def has_settle_work(self) -> bool:
        """:meth:`plan_settle` has something to send (frees, late tokens, pins, swap ends)."""
        return bool(
            self._pending_frees or self._pending_late or self._pending_pins
            or self._pending_unpins or self._pending_completes
        )  # fmt: skip

    def unpin(self, pool_pin_id: int) -> None:
        """Release a pinned prefix in the next transaction."""
        self._pending_unpins.append(pool_pin_id)

    # ---- planning -------------------------------------------------------------------------

    def can_plan_ahead(self) -> bool:
        """Whether a step may be planned while one is in flight (:meth:`plan`'s ``ahead``), as
        far as the queues go: nothing swapped or being swapped (a swap would copy blocks the
        step in flight may still write)."""
        return not (self.swapped or self._swaps)

    def plan(self, snap: PoolSnapshot, ahead: SchedulerOutput | None = None) -> StepTxn:
        """Decide the next step against the allocator's snapshot.

        ``ahead``: the step in flight, whose sampled tokens are not back yet (async scheduling;
        only when :meth:`can_plan_ahead`, and no sequence it samples belongs to a request with
        beams or verifies proposals; a request at its fan-out there sits this plan out, its
        new sequences do not exist yet). The other sequences decode a late token
        (``LATE_TOKEN``, the runner puts in the token it sampled), unless their length ends
        them; nothing is preempted, swapped or restarted: the plan stops where the sync rules
        would do that (:attr:`planned_cut`), and admits nothing then."""
        cfg = self.config
        plan = PlanBudget(
            budget_left=cfg.max_num_batched_tokens,
            seats_left=cfg.max_num_seqs,
            free=snap.num_free_device_blocks,
        )
        if ahead is not None:
            assert self.can_plan_ahead()
            plan.pending = {s.seq_id for s in ahead.seqs if s.samples}
        frees, self._pending_frees = self._pending_frees, []
        completes, self._pending_completes = self._pending_completes, []
        forks, self._pending_forks = self._pending_forks, []
        pins, self._pending_pins = self._pending_pins, []
        unpins, self._pending_unpins = self._pending_unpins, []
        # Forks land in this transaction and swapped-in sequences were not on the device at the
        # snapshot: count their partial last blocks as shared (a copy-on-write may be due).
        shared = snap.shared_tails | {s for pair in forks for s in pair} | self._swapped_back
        self._swapped_back = set()
        if self.policy.is_priority:
            claim_for_priority(self, plan)
            if ahead is not None and plan.claim is not None:
                plan.claim, plan.cut = None, True  # the claim preempts once the step is back
        appends, sizes = plan_running(self, plan, shared, frees)
        self.planned_cut = plan.cut
        pressure = plan.short or plan.claim is not None
        swap_ins: list[tuple[int, ...]] = []
        admissions: list[Admission] = []
        if plan.cut:  # planned ahead, stopped short: nothing comes in, no one goes
            self._victims = []
        else:
            swap_ins, admissions = self._plan_queues(plan, pressure)
        late, self._pending_late = self._pending_late, []
        truncates, self._pending_truncates = self._pending_truncates, []
        if truncates and frees:  # a sequence freed now (finished, restarted) keeps nothing
            gone = set(frees)
            truncates = [t for t in truncates if t[0] not in gone]
        num_draft = tuple(n for _, _, n in self._planned)
        self.num_plans += 1
        return StepTxn(
            late_tokens=tuple(late),
            complete_swaps=tuple(completes),
            forks=tuple(forks),
            pins=tuple(pins),
            unpins=tuple(unpins),
            frees=tuple(frees),
            append_seq_ids=tuple(seq_id for seq_id, _ in appends),
            append_token_ids=tuple(tokens for _, tokens in appends),
            append_num_draft=num_draft if any(num_draft) else (),
            truncates=tuple(truncates),
            swap_ins=tuple(swap_ins),
            admissions=tuple(admissions),
            watermark_blocks=self._watermark if self.running else 0,
            victims=tuple(tuple(s.seq_id for s in r.live_seqs) for r in self._victims),
            append_group_sizes=tuple(sizes) if pressure else (),
            swap_victims=cfg.preemption_mode == "swap",
            claim=plan.claim,
        )

    def plan_settle(self) -> StepTxn:
        """A transaction of the pending frees, late tokens' values, forks, pins, unpins and
        swap confirmations alone (no step): with a step in flight that the next cannot be
        planned ahead of, a finished request's blocks return to the pool at once. (A fork is
        pending here only from a fan-out that sat the step in flight out, so no block it
        shares is being written; a sequence it makes may already be among the frees.)"""
        txn = StepTxn(
            late_tokens=tuple(self._pending_late),
            complete_swaps=tuple(self._pending_completes),
            forks=tuple(self._pending_forks),
            pins=tuple(self._pending_pins),
            unpins=tuple(self._pending_unpins),
            frees=tuple(self._pending_frees),
        )
        self._pending_late, self._pending_completes, self._pending_pins = [], [], []
        self._pending_unpins, self._pending_frees, self._pending_forks = [], [], []
        return txn

    def _plan_queues(
        self, plan: PlanBudget, pressure: bool
    ) -> tuple[list[tuple[int, ...]], list[Admission]]:
        """Under pressure the running groups are the victims and nothing comes in; else the
        swap-ins and admissions, in queue (FCFS) or rank (priority) order."""
        swap_ins: list[tuple[int, ...]] = []
        admissions: list[Admission] = []
        if pressure:
            self._victims = self.running[::-1]
        else:
            self._victims = []
            if self.policy.is_priority:
                swap_ins, admissions = plan_in_rank_order(self, plan)
            else:
                swap_ins = plan_swap_ins(self, plan)
                if not self.swapped:
                    admissions = plan_admissions(self.waiting, plan)
        return swap_ins, admissions

    # ---- applying the allocator's result --------------------------------------------------

    def apply(self, txn: StepTxn, result: TxnResult) -> SchedulerOutput:
        """Settle admissions and swaps and build the step the executor runs."""
        return apply_result(self, txn, result)

    # ---- after the step -------------------------------------------------------------------

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[int, SeqOf[int]],
        top: Mapping[int, tuple[tuple[int, float], ...]] | None = None,
    ) -> list[SeqUpdate]:
        """Append each sampled token, apply the stop rules, queue frees of what finished.

        ``sampled[seq_id]`` holds one token per draw of that row: ``num_samples`` of them at a
        fan-out, where sequence 0 takes the first and sequences 1.. are forked for the others.
        For beam-search requests ``top[seq_id]`` (each beam's best tokens and logprobs) drives
        the beam step instead, once every beam of the request has reported.
        """
        return update_step(self, output, sampled, top)

    def append_forced(
        self, request_id: str, seq_id: int, tokens: SeqOf[int]
    ) -> tuple[tuple[int, ...], str | None, int | str | None]:
        """Jump-forward (structured outputs): append tokens a grammar forces after the sampled
        one, uncomputed; the next step computes them with it like a prefill chunk and samples
        after the last. The stop rules apply token by token (they count toward max_tokens):
        appending ends at the first token that finishes the sequence. Returns the tokens
        appended and the sequence's finish and stop reasons. A sample already in flight for
        the sequence (a step planned ahead) becomes void (:meth:`sample_is_void`)."""
        return append_forced(self, request_id, seq_id, tokens)

    def sample_is_void(self, seq_id: int) -> bool:
        """Whether the sample in flight for ``seq_id`` will be dropped (tokens a grammar forced
        come first: :meth:`append_forced`)."""
        return seq_id in self._void

    def finish_seq(self, request_id: str, seq_id: int, reason: str, stop: int | str | None) -> None:
        """End a sequence from outside (a stop string matched in its text)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        seq = next(s for s in request.seqs if s.seq_id == seq_id)
        if seq.is_finished:
            return
        seq.finish_reason, seq.stop_reason = reason, stop
        self._release(seq)
        if request.is_finished:
            self._finish(request)
            self.num_finished += 1

    def _release(self, seq: Sequence) -> None:
        self._late.discard(seq.seq_id)  # (its free drops the late token with the table)
        self._void.discard(seq.seq_id)
        if seq.has_blocks:
            seq.has_blocks = False
            self._pending_frees.append(seq.seq_id)

    def _finish(self, request: Request) -> None:
        """Drop a finished request from its queue; its blocks are freed by the next txn (after
        its prefix is pinned, if it was computing one to pin)."""
        del self.requests[request.request_id]
        if request.pin_id is not None and request.seqs[0].finish_reason != "abort":
            seq = request.seqs[0]
            prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
            pin = PinOp(pin_id=request.pin_id, token_ids=prompt, extra_key=request.cache_key)
            self._pending_pins.append(pin)
        status = request.status
        request.status = RequestStatus.FINISHED
        if status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.swapped.remove(request)
            if request.swap_id is not None:
                self._swaps[request.swap_id] = None
        for seq in request.seqs:
            self._release(seq)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_preemptions=self.num_preemptions,
            num_swap_outs=self.num_swap_outs,
            num_swap_ins=self.num_swap_ins,
            num_recomputes=self.num_recomputes,
            num_rope_restarts=self.num_rope_restarts,
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
        )
