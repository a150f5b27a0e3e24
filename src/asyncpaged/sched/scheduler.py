"""Iteration-level scheduling: FCFS or priorities (sched/policy.py); pure Python, no pool.

The scheduler owns the queues and request state; the allocator owns the block pool. One step::

    txn = scheduler.plan(snapshot)           # decisions against the allocator's exact snapshot
    result = apply_txn(pool, txn)            # the allocator (its own actor in the engine)
    output = scheduler.apply(txn, result)    # admissions settled, the step's plan built
    ... the executor runs output (copy-on-write first), swaps run beside it ...
    outputs = scheduler.update(output, sampled)  # the runner's rows -> EngineCoreOutputs

The plan, in order:

1. running requests, oldest first: a decode token per sequence, or the next prefill chunk. A
   request whose blocks do not fit preempts the newest running request (all its sequences: by
   swap to the host pool, or by recompute) until it fits, or waits a step when blocks being
   swapped out will free enough. How far that goes only the pool knows exactly, so when the
   plan's needs exceed the snapshot's free blocks the transaction carries the running groups
   as victims and the allocator preempts (kv/txn.py); :meth:`Scheduler.apply` settles them;
2. if the needs fit: swapped requests come back in, oldest first;
3. if the needs fit and nothing is swapped: waiting requests are offered for admission, oldest
   first, within the token and sequence budgets (chunked prefill); the allocator admits a prefix
   of them.

Finished and aborted sequences are freed, and completed swaps confirmed, in the next
transaction.

This module holds the :class:`Scheduler` (the queues, request state and the transaction's
pending work) with all of its steps as methods: planning (what the running, swapped and
waiting requests do in a step, the long-RoPE restart, speculative proposals), preemption
(priority preemption, applying the allocator's preemptions), applying the allocator's result
(granted appends, swaps and admissions built into a :class:`SchedulerOutput`) and the update
after a step (sampled tokens under the stop rules, speculative verification, parallel
sampling's fork at the prompt's end, beam steps, jump-forward). The pure helpers over a
request's sequences (chunks, block needs, stop rules) sit beside it; the config and output
records are in sched/scheduler_types.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from collections.abc import Sequence as SeqOf
from collections.abc import Set as AbstractSet

from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN, SwapPlan
from asyncpaged.kv.txn import (
    Admission,
    AllocateOp,
    PendingOps,
    PinOp,
    PoolSnapshot,
    PriorityPreemption,
    StepTxn,
    TxnResult,
)
from asyncpaged.sampled_token import SampledToken
from asyncpaged.sched.beam_search import Hypothesis
from asyncpaged.sched.policy import QueuePolicy, Room, num_outranked
from asyncpaged.sched.request import Request, RequestStatus, Sequence
from asyncpaged.sched.scheduler_types import (
    EngineCoreOutput,
    PlanBudget,
    PreemptionMode,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStatistics,
    insort,
    new_tuple,
)
from asyncpaged.spec_decode.stats import SpeculativeStats

__all__ = [
    "EngineCoreOutput",
    "PreemptionMode",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStatistics",
]


_LATE_ROW = (PLACEHOLDER_TOKEN,)  # a late row's one input token: the one the step in flight samples
Chunks = list[tuple[Sequence, int]]  # (sequence, tokens to compute)
Drafts = dict[int, tuple[int, ...]]  # seq id -> speculative proposals


def chunks_of(request: Request, plan: PlanBudget) -> Chunks | None:
    """(sequence, tokens to compute) for a running request, or None if over budget; empty when
    none of its sequences has anything to compute this step."""
    if len(request.seqs) == 1:  # the common case, without the list building below
        seq = request.seqs[0]
        if seq.finish_reason is None:
            if plan.seqs_left < 1 or plan.budget_left < 1:
                return None
            todo = len(seq.token_ids) - seq.num_computed_tokens
            return [(seq, min(todo, plan.budget_left))] if todo else []
    seqs = request.live_seqs
    if plan.seqs_left < len(seqs) or plan.budget_left < len(seqs):
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


def plan_admissions(
    waiting: list[Request], plan: PlanBudget, loras: tuple[set[str], int] | None = None
) -> list[Admission]:
    """Waiting requests offered for admission, in queue order, within the budgets; ``loras``:
    the adapters of the requests holding blocks and ``max_loras`` (a request whose adapter
    would make one too many waits, and those behind it are offered still)."""
    admissions: list[Admission] = []
    for request in waiting:
        if loras is not None and request.lora_key is not None:
            active, max_loras = loras
            if request.lora_key not in active:
                if len(active) >= max_loras:
                    continue
                active.add(request.lora_key)
        seqs = request.live_seqs
        if plan.seqs_left < len(seqs) or plan.budget_left < len(seqs):
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
        plan.seqs_left -= len(seqs)
    return admissions


def draws_by_seq(sampled: SeqOf[SampledToken]) -> dict[int, list[SampledToken]]:
    """A step's rows by sequence, each sequence's in sample order (a fork's draws)."""
    draws: dict[int, list[SampledToken]] = {}
    for t in sorted(sampled, key=_seq_and_sample):
        draws.setdefault(t.seq_id, []).append(t)
    return draws


def _seq_and_sample(t: SampledToken) -> tuple[int, int]:
    return t.seq_id, t.sample_index


def check_stop(request: Request, seq: Sequence, token: int) -> bool:
    """Set the sequence's finish reason if ``token`` ends it; True if it did."""
    stop = request.stop
    num_tokens = len(seq.token_ids)
    num_generated = num_tokens - seq.num_prompt_tokens
    if num_generated >= stop.min_tokens:
        if token in stop.eos_token_ids and not stop.ignore_eos:
            seq.finish_reason = "stop"
        elif token in stop.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
    if seq.finish_reason is None and (
        num_generated >= stop.max_tokens
        or (stop.max_model_len is not None and num_tokens >= stop.max_model_len)
    ):
        seq.finish_reason = "length"
    return seq.finish_reason is not None


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
    * Queues are sorted by :attr:`Request.queue_key` (sched/policy.py): arrival under FCFS.
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
        self.finished_beams: list[tuple[str, list[Hypothesis]]] = []  # drained by the caller
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._swaps: dict[int, Request | None] = {}  # swap id -> request (None: aborted)
        self._swapped_back: set[int] = set()
        self._pending = PendingOps()  # the next transaction's mandatory operations
        # Async scheduling: sequences whose last appended slot holds a placeholder in the pool,
        # and (seq id, value) of those whose value came back, for the next transaction
        self._placeholders: set[int] = set()
        # sequences whose sample in flight is discarded: a grammar forced the tokens after the
        # token before it (append_forced), so the next plan computes those instead
        self._discarded: set[int] = set()
        self.planned_cut = False  # the last plan, made ahead, stopped short (see plan)
        # rows planned ahead whose sample was not used: their request ended meanwhile, or
        # their sample was discarded
        self.num_discarded_rows = 0
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
        self._pending.complete_swaps.append(swap_id)
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
        return self._pending.has_work

    @property
    def can_flush(self) -> bool:
        """:meth:`plan_flush` has something to send (frees, placeholders, pins, swap ends)."""
        return self._pending.can_flush

    def unpin(self, pool_pin_id: int) -> None:
        """Release a pinned prefix in the next transaction."""
        self._pending.unpins.append(pool_pin_id)

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
        beams or verifies proposals; a request at its fork there sits this plan out, its
        new sequences do not exist yet). The other sequences decode a placeholder
        (``PLACEHOLDER_TOKEN``, the runner puts in the token it sampled), unless their length ends
        them; nothing is preempted, swapped or restarted: the plan stops where the sync rules
        would do that (:attr:`planned_cut`), and admits nothing then."""
        cfg = self.config
        plan = PlanBudget(
            budget_left=cfg.max_num_batched_tokens,
            seqs_left=cfg.max_num_seqs,
            free=snap.num_free_device_blocks,
        )
        if ahead is not None:
            assert self.can_plan_ahead()
            plan.pending = {s.seq_id for s in ahead.seqs if s.samples}
        pending, self._pending = self._pending, PendingOps()
        frees, forks = pending.frees, pending.forks
        # Forks land in this transaction and swapped-in sequences were not on the device at the
        # snapshot: count their partial last blocks as shared (a copy-on-write may be due).
        shared = snap.shared_tails | {s for pair in forks for s in pair} | self._swapped_back
        self._swapped_back = set()
        if self.policy.is_priority:
            self._plan_priority_preemption(plan)
            if ahead is not None and plan.preemption is not None:
                plan.preemption, plan.cut = None, True  # it preempts once the step is back
        append_ids, append_tokens, sizes = self._plan_running(plan, shared, frees)
        self.planned_cut = plan.cut
        pressure = plan.short or plan.preemption is not None
        swap_ins: list[tuple[int, ...]] = []
        admissions: list[Admission] = []
        if plan.cut:  # planned ahead, stopped short: nothing comes in, no one goes
            self._victims = []
        else:
            swap_ins, admissions = self._plan_queues(plan, pressure)
        truncates = pending.truncates
        if truncates and frees:  # a sequence freed now (finished, restarted) keeps nothing
            gone = set(frees)
            truncates = [t for t in truncates if t[0] not in gone]
        num_draft = tuple([n for _, _, n in self._planned])
        self.num_plans += 1
        return StepTxn(
            placeholder_values=tuple(pending.placeholder_values),
            complete_swaps=tuple(pending.complete_swaps),
            forks=tuple(forks),
            pins=tuple(pending.pins),
            unpins=tuple(pending.unpins),
            frees=tuple(frees),
            append_seq_ids=tuple(append_ids),
            append_token_ids=tuple(append_tokens),
            append_num_draft=num_draft if any(num_draft) else (),
            truncates=tuple(truncates),
            swap_ins=tuple(swap_ins),
            admissions=tuple(admissions),
            watermark_blocks=self._watermark if self.running else 0,
            victims=tuple(tuple(s.seq_id for s in r.live_seqs) for r in self._victims),
            append_group_sizes=tuple(sizes) if pressure else (),
            swap_victims=cfg.preemption_mode == "swap",
            preemption=plan.preemption,
        )

    def plan_flush(self) -> StepTxn:
        """A transaction of the pending frees, placeholders' values, forks, pins, unpins and
        swap confirmations alone (no step): with a step in flight that the next cannot be
        planned ahead of, a finished request's blocks return to the pool at once. (A fork is
        pending here only from a fork that sat the step in flight out, so no block it
        shares is being written; a sequence it makes may already be among the frees.)"""
        return self._pending.flush()

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
                swap_ins, admissions = self._plan_in_rank_order(plan)
            else:
                swap_ins = self._plan_swap_ins(plan)
                if not self.swapped:
                    admissions = plan_admissions(self.waiting, plan, self._lora_room())
        return swap_ins, admissions

    def _plan_running(
        self, plan: PlanBudget, shared: AbstractSet[int | str], frees: list[int]
    ) -> tuple[list[int], list[tuple[int, ...]], list[int]]:
        """The running requests' appends in queue order, within the budgets: the sequence ids,
        the tokens of each, and the number of sequences per request. Where the blocks run short
        (``plan.short``) the allocator preempts; the needs here are upper bounds (a tail
        counted as shared may not be). Records the appends in ``self._planned``."""
        append_ids: list[int] = []
        append_tokens: list[tuple[int, ...]] = []
        sizes: list[int] = []
        planned = self._planned = []
        running = self.running
        i = 0
        pending = plan.pending
        discarded = self._discarded
        long_rope = self.config.rope_switch_len is not None  # (a longrope model's switch)
        while i < len(running):
            request = running[i]
            if pending is None:
                late = False
            elif (
                len(request.seqs) == 1
            ):  # (a discarded sample in flight: the forced tokens are known)
                sid = request.seqs[0].seq_id
                late = sid in pending and not (discarded and sid in discarded)
            else:  # parallel sampling: each sequence whose token is in flight (_late_step_of)
                late = any(s.seq_id in pending for s in request.seqs)
            step = (
                self._late_step_of(request, plan, shared)
                if late
                else self._step_of(request, plan, shared)
            )
            if step is None:
                break  # token or sequence budget spent
            chunks, drafts, need = step
            if not chunks:
                i += 1  # nothing to compute (beams that reported wait for their siblings)
                continue
            if long_rope and _outgrows_short_rope(self.config, request, chunks):
                behind = _still_short(self.config, chunks)
                if behind:  # (its sequences apart, by kept proposals: these catch up first)
                    chunks = behind
                    drafts, need = self._proposals_and_need(chunks, drafts, shared)
                elif pending is not None:  # (a request in flight keeps its blocks until it returns)
                    plan.cut = True
                    break
                else:
                    self._restart_long_rope(request, frees)
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
                tokens = _LATE_ROW if at_end else (*seq.token_ids[start : start + n], *draft)
                append_ids.append(seq.seq_id)
                append_tokens.append(tokens)
                planned.append((request, seq, len(draft)))
                plan.budget_left -= len(tokens)
                plan.seqs_left -= 1
            i += 1
        return append_ids, append_tokens, sizes

    def _late_step_of(
        self, request: Request, plan: PlanBudget, shared: AbstractSet[int | str]
    ) -> tuple[Chunks, Drafts, int] | None:
        """Planning ahead (async scheduling): the decodes of a request's sequences whose next tokens
        the step in flight is sampling, each as a placeholder; no chunk for one that its token ends
        by its length for sure (an end by a stop token is known only then: the row is computed and
        discarded), nor for a request whose fork is in flight (it sits this step out: its other
        sequences exist once that step is back, and its next plan forks them). A parallel-sampling
        request with a sequence that has known tokens to compute first (a grammar's forced ones
        after a discarded sample) waits for the step in flight: no chunks now."""
        stop = request.stop
        bs = self.config.block_size
        if len(request.seqs) == 1:  # the common case, without the list building below
            if plan.seqs_left < 1 or plan.budget_left < 1:
                return None
            seq = request.seqs[0]
            if request.num_samples > 1 and not seq.num_generated:
                return (
                    [],
                    {},
                    0,
                )  # its fork is in flight: its sequences exist once it is back
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
        if plan.seqs_left < len(live) or plan.budget_left < len(live):
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
        self, request: Request, plan: PlanBudget, shared: AbstractSet[int | str]
    ) -> tuple[Chunks, Drafts, int] | None:
        """A running request's chunks, proposals and block need this step; None if the budgets
        are spent, no chunks if it has nothing to compute."""
        seqs = request.seqs
        if len(seqs) == 1 and seqs[0].finish_reason is None:  # the common case, inline
            if plan.seqs_left < 1 or plan.budget_left < 1:
                return None
            seq = seqs[0]
            have = seq.num_computed_tokens
            n = min(len(seq.token_ids) - have, plan.budget_left)
            if not n:
                return [], {}, 0
            chunks = [(seq, n)]
            drafts = (
                self._plan_drafts(request, chunks, plan.budget_left)
                if request.num_speculative_tokens
                else {}
            )
            if drafts:
                n += len(drafts[seq.seq_id])
            bs = self.config.block_size
            return chunks, drafts, -(-(have + n) // bs) - -(-have // bs) + (seq.seq_id in shared)
        some = chunks_of(request, plan)
        if some is None:
            return None
        if not some:
            return [], {}, 0
        drafts = self._plan_drafts(request, some, plan.budget_left)
        bs = self.config.block_size
        need = sum(
            blocks_to_append(s, n + len(drafts.get(s.seq_id, ())), s.seq_id in shared, bs)
            for s, n in some
        )
        return some, drafts, need

    def _plan_drafts(self, request: Request, chunks: Chunks, budget: int) -> Drafts:
        """Speculative decoding: proposals for the decodes among ``chunks`` (sequences whose
        one new token is their last), within the token budget and never past ``max_tokens``
        or ``max_model_len`` (a step emits at most its proposals + 1 tokens), nor, for a request
        in longrope's short regime, past the switch (a verification row there would rotate with
        the short factors where transformers uses the long ones: the next decode restarts it)."""
        k = request.num_speculative_tokens
        propose = self._propose
        if not k or propose is None:
            return {}
        limit_batch = self.config.spec_disable_by_batch_size
        if limit_batch is not None and len(self.running) > limit_batch:
            return {}
        budget -= sum(n for _, n in chunks)
        stop = request.stop
        switch = self.config.rope_switch_len
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
            elif self.config.spec_async:  # found nothing: waiting for the token was to no use
                self.back_off(seq, self.num_plans + 1)
        return drafts

    def back_off(self, seq: Sequence, next_plan: int) -> None:
        """Pause a sequence's proposals after a round that kept none (with async scheduling,
        also one whose proposer found none): each such round in a row doubles the pause, 1, 2, 4
        .. 16 of its decodes; ``next_plan``: the count of the next plan. With async scheduling the
        pause is stretched (by less than its length) to end on a plan whose count is a multiple of
        its length, so backed-off sequences propose on the same steps and the rest go ahead."""
        pause = seq.spec_backoff = min(16, 2 * seq.spec_backoff or 1)
        if self.config.spec_async:
            pause += -(next_plan + pause) % pause
        seq.spec_skip = pause

    def next_proposals(self, request: Request, seq: Sequence) -> int:
        """How many proposals the decode after ``seq``'s token in flight may carry (the draft
        model draws that many at the end of the step): none while it backs off, above
        ``spec_disable_by_batch_size`` running requests, or near ``max_tokens`` or
        ``max_model_len``, or, in longrope's short regime, the switch (see :meth:`_plan_drafts`)."""
        k = request.num_speculative_tokens
        if not k or seq.spec_skip or self._propose is None:
            return 0
        limit = self.config.spec_disable_by_batch_size
        if limit is not None and len(self.running) > limit:
            return 0
        stop = request.stop
        room = stop.max_tokens - seq.num_generated - 2
        if stop.max_model_len is not None:
            room = min(room, stop.max_model_len - len(seq.token_ids) - 2)
        switch = self.config.rope_switch_len
        if switch is not None and not request.long_rope:
            room = min(room, switch - len(seq.token_ids) - 1)
        return max(0, min(k, room))

    def _proposals_and_need(
        self, chunks: Chunks, drafts: Drafts, shared: AbstractSet[int | str]
    ) -> tuple[Drafts, int]:
        """The proposals of ``chunks``' sequences among ``drafts``, and the chunks' block need."""
        bs = self.config.block_size
        kept = {s.seq_id: drafts[s.seq_id] for s, _ in chunks if s.seq_id in drafts}
        need = sum(
            blocks_to_append(s, n + len(kept.get(s.seq_id, ())), s.seq_id in shared, bs)
            for s, n in chunks
        )
        return kept, need

    def _restart_long_rope(self, request: Request, frees: list[int]) -> None:
        """Recompute a request from its first token in the long RoPE regime: its cached K/V
        were rotated with the short factors. Frees land before admissions in the transaction,
        so it may be admitted again in this very step (under its long-regime cache key)."""
        self.running.remove(request)
        request.long_rope = True
        frees.extend(s.seq_id for s in request.live_seqs)
        self._requeue_for_recompute(request)
        self.num_rope_restarts += 1

    def _requeue_for_recompute(self, request: Request) -> None:
        """``request``'s sequences lost their blocks: it waits to be computed again from its
        first token. A beam that reported before its siblings reports again once recomputed, so
        the rows its beams reported are forgotten (else one update would step the search twice)."""
        for seq in request.live_seqs:
            seq.num_computed_tokens = 0
            seq.has_blocks = False
        request.beam_top.clear()
        request.status = RequestStatus.WAITING
        insort(self.waiting, request)

    def _plan_in_rank_order(
        self, plan: PlanBudget
    ) -> tuple[list[tuple[int, ...]], list[Admission]]:
        """Priority policy: swapped requests ranked above the best waiting one come back first;
        the waiting ones are offered once every one of those is coming back."""
        limit = self.waiting[0].queue_key if self.waiting else None
        swap_ins = self._plan_swap_ins(plan, before=limit)
        coming = {s for group in swap_ins for s in group}
        if limit is None or any(
            r.status is not RequestStatus.SWAPPING_IN
            and r.live_seqs[0].seq_id not in coming
            and r.queue_key < limit
            for r in self.swapped
        ):
            return swap_ins, []
        return swap_ins, plan_admissions(self.waiting, plan, self._lora_room())

    def _lora_room(self) -> tuple[set[str], int] | None:
        """The adapters of the requests holding blocks (running or swapped), and
        ``max_loras``; None when LoRA is off."""
        if not self.config.max_loras:
            return None
        active = {r.lora_key for r in self.running if r.lora_key is not None}
        active.update(r.lora_key for r in self.swapped if r.lora_key is not None)
        return active, self.config.max_loras

    def _plan_swap_ins(
        self, plan: PlanBudget, before: tuple[int, int] | None = None
    ) -> list[tuple[int, ...]]:
        """Swapped requests back in, in queue order (those ranked before ``before``)."""
        bs = self.config.block_size
        groups: list[tuple[int, ...]] = []
        for request in self.swapped:
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
            if need + step + self._watermark > plan.free:
                break  # first come, first served: no one overtakes
            plan.free -= need
            groups.append(tuple(s.seq_id for s in request.live_seqs))
        return groups

    # ---- preemption -----------------------------------------------------------------------

    def _plan_priority_preemption(self, plan: PlanBudget) -> None:
        """Priority policy: age the waiting and swapped requests; if the best waiting request
        lacks room for its sequences or blocks (estimated without prefix-cache hits), plan to
        preempt the running groups it outranks (``plan.preemption``: the allocator preempts the
        fewest of them that make room, exactly, or none; sched/policy.py's rule)."""
        policy, cfg = self.policy, self.config
        policy.age(self.waiting)
        policy.age(self.swapped)
        if not self.waiting or not self.running:
            return
        best = self.waiting[0]
        if self.swapped and (
            self.swapped[0].queue_key < best.queue_key
            or any(r.status is RequestStatus.SWAPPING_OUT for r in self.swapped)
        ):
            return  # a better swapped request comes first; or blocks are still coming back
        seqs = best.live_seqs
        chunk = max(1, plan.budget_left // len(seqs))
        bs = cfg.block_size
        need = Room(
            num_seqs=len(seqs),
            blocks=sum(-(-min(len(s.token_ids), chunk) // bs) for s in seqs) + self._watermark,
        )
        num_seqs = cfg.max_num_seqs - sum(len(r.live_seqs) for r in self.running)
        if num_seqs >= need.num_seqs and plan.free >= need.blocks:
            return
        outranked = num_outranked(policy, best, self.running)
        if outranked:
            plan.preemption = PriorityPreemption(
                num_victims=outranked, num_seqs=need.num_seqs - num_seqs, blocks=need.blocks
            )

    def _apply_preemption(self, request: Request, swapped: bool) -> None:
        """The allocator preempted ``request`` (all its sequences): swapped out, or freed to be
        recomputed."""
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if swapped:
            request.status = RequestStatus.SWAPPING_OUT
            insort(self.swapped, request)
            self.num_swap_outs += 1
            return
        self._requeue_for_recompute(request)  # the allocator freed its blocks
        self.num_recomputes += 1

    # ---- applying the allocator's result --------------------------------------------------

    def apply(self, txn: StepTxn, result: TxnResult) -> SchedulerOutput:
        """Settle admissions and swaps and build the step the executor runs."""
        seqs: list[ScheduledSeq] = []
        num_tokens = 0
        # The allocator grants a prefix of the planned appends (all of them without pressure).
        num_appended = len(result.append_slots)
        appended = zip(
            self._planned[:num_appended], txn.append_token_ids, result.append_slots,
            result.append_tables, strict=False,
        )  # fmt: skip
        for (request, seq, num_draft), tokens, slots, table in appended:
            num_tokens += self._schedule(
                seqs, request, seq, seq.num_computed_tokens, tokens, slots, table, num_draft
            )
        preempted = self._victims[: len(result.preempted)]
        for request, swapped in zip(preempted, result.preempted, strict=True):
            self._apply_preemption(request, swapped)
        self._apply_swaps(result)
        for request_id, grants in result.admitted:
            request = self.requests[request_id]
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            insort(self.running, request)
            by_id = {s.seq_id: s for s in request.live_seqs}
            for grant in grants:
                seq = by_id[grant.seq_id]
                request.num_cached_tokens = max(request.num_cached_tokens, grant.num_cached_tokens)
                start = grant.num_cached_tokens
                tokens = tuple(seq.token_ids[start : start + len(grant.slot_mapping)])
                num_tokens += self._schedule(
                    seqs, request, seq, start, tokens, grant.slot_mapping, grant.block_table
                )
        return SchedulerOutput(
            step_id=next(self._step_ids),
            seqs=tuple(seqs),
            copy_on_write=result.copy_on_write,
            swap_outs=result.swap_outs,
            swap_ins=result.swap_ins,
            preempted=tuple(r.request_id for r in preempted),
            num_batched_tokens=num_tokens,
        )

    def _apply_swaps(self, result: TxnResult) -> None:
        """Record the swaps the allocator started: out (blocks mapped) and in."""
        for plan in result.swap_outs:
            request = self._swap_owner(plan)
            request.swap_id = plan.swap_id
            self._swaps[plan.swap_id] = request
            request.num_swap_blocks = len(plan.block_mapping)
        for plan in result.swap_ins:
            request = self._swap_owner(plan)
            assert request.status is RequestStatus.SWAPPED
            request.status = RequestStatus.SWAPPING_IN
            self.num_swap_ins += 1
            request.swap_id = plan.swap_id
            self._swaps[plan.swap_id] = request

    def _schedule(
        self,
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
        if tokens[0] == PLACEHOLDER_TOKEN:  # the token the step in flight samples: one past the end
            self._placeholders.add(seq.seq_id)
        # (a placeholder's row computes one past the end: the step in flight samples its input)
        samples = seq.num_computed_tokens >= len(seq.token_ids)
        fan_out = samples and len(request.seqs) == 1 and seq.num_generated == 0
        row = (
            request.request_id, seq.seq_id, tokens, start, slots, table, samples,
            request.num_samples if fan_out else 1,
            self._min_rope_len if request.long_rope else 0, num_draft,
        )  # fmt: skip
        out.append(new_tuple(ScheduledSeq, row))
        return n

    def _swap_owner(self, plan: SwapPlan) -> Request:
        seq_id = plan.seq_ids[0]
        return next(r for r in self.swapped if any(s.seq_id == seq_id for s in r.seqs))

    # ---- after the step -------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled: SeqOf[SampledToken]
    ) -> list[EngineCoreOutput]:
        """Append each sampled token, apply the stop rules, queue frees of what finished;
        returns each completion's new tokens with the row that drew them.

        ``sampled`` holds the step's rows (the runner's ``StepResult.sampled``): one per
        sampling sequence, or ``num_samples`` at a fork (sample ``i`` in the row with
        ``sample_index`` i), where sequence 0 takes the first and sequences 1.. are forked for
        the others; a speculative row holds the kept proposals before its token. For
        beam-search requests each beam's row's ``top_logprobs`` drives the beam step instead,
        once every beam of the request has reported.
        """
        # each sequence's first row (the only one but at a fork)
        rows = {t.seq_id: t for t in sampled if not t.sample_index}
        fanned: dict[int, list[SampledToken]] | None = None  # every row by sequence, if needed
        outputs: list[EngineCoreOutput] = []
        beams: list[Request] = []
        discarded, requests = self._discarded, self.requests
        for scheduled in output.seqs:
            request = requests.get(scheduled.request_id)
            if request is None or not scheduled.samples:
                # aborted meanwhile, or a prefill chunk short of the prompt's end; a placeholder's
                # row whose request the step before ended (or an abort) was computed and discarded
                if request is None and scheduled.token_ids[0] == PLACEHOLDER_TOKEN:
                    self.num_discarded_rows += 1
                continue
            seq = request.seqs[0]
            if seq.seq_id != scheduled.seq_id:
                seq = next(s for s in request.seqs if s.seq_id == scheduled.seq_id)
            if seq.finish_reason is not None:
                continue
            if discarded and seq.seq_id in discarded:  # forced tokens replaced this sample
                discarded.remove(seq.seq_id)
                self.num_discarded_rows += 1
                continue
            row = rows[seq.seq_id]
            if request.beam is not None:
                request.beam_top[seq.seq_id] = row.top_logprobs
                if len(request.beam_top) == len(request.live_seqs):
                    beams.append(request)
                continue
            if scheduled.num_draft:
                outputs.append(self._verified(request, seq, scheduled.num_draft, row))
                if seq.is_finished and request.is_finished:
                    self._finish(request)
                    self.num_finished += 1
                continue
            if scheduled.num_samples == 1 and len(request.seqs) == 1:  # the common case
                outputs.append(self._append_one(request, seq, row))
                continue
            draws = [row]
            if scheduled.num_samples > 1:
                if fanned is None:
                    fanned = draws_by_seq(sampled)
                draws = fanned[seq.seq_id]
            outputs.extend(self._append_family(request, seq, scheduled.num_samples, draws))
        for request in beams:
            self._beam_step(request)
        return outputs

    def append_forced(
        self, request_id: str, seq_id: int, tokens: SeqOf[int]
    ) -> tuple[tuple[int, ...], str | None, int | str | None]:
        """Jump-forward (structured outputs): append tokens a grammar forces after the sampled
        one, uncomputed; the next step computes them with it like a prefill chunk and samples
        after the last. The stop rules apply token by token (they count toward max_tokens):
        appending ends at the first token that finishes the sequence. Returns the tokens
        appended and the sequence's finish and stop reasons. A sample already in flight for
        the sequence (a step planned ahead) is discarded (:meth:`sample_is_discarded`)."""
        request = self.requests.get(request_id)
        seq = None if request is None else next(s for s in request.seqs if s.seq_id == seq_id)
        if request is None or seq is None or seq.is_finished:
            return (), None, None
        if tokens and seq.num_computed_tokens == len(seq.token_ids):  # a step planned ahead
            self._discarded.add(seq.seq_id)  # samples next: that sample is discarded
        appended = self._append_until_stop(request, seq, tokens)
        if request.is_finished:  # this sequence stopped, and it was the request's last
            self._finish(request)
            self.num_finished += 1
        return appended, seq.finish_reason, seq.stop_reason

    def _append_one(self, request: Request, seq: Sequence, row: SampledToken) -> EngineCoreOutput:
        """A single-sequence request's sampled token (the value of its placeholder, if the step
        after was planned before it came back)."""
        token = row.token_id
        seq.token_ids.append(token)
        if self._placeholders and seq.seq_id in self._placeholders:
            self._placeholders.remove(seq.seq_id)
            self._pending.placeholder_values.append((seq.seq_id, token))
        finished = check_stop(request, seq, token)
        output = new_tuple(EngineCoreOutput, (  # the common case's one allocation per row
            request.request_id, seq.seq_id, seq.index, (token,), seq.finish_reason,
            seq.stop_reason, row,
        ))  # fmt: skip
        if finished:
            self._release(seq)
            self._finish(request)
            self.num_finished += 1
        return output

    def _append_family(
        self, request: Request, seq: Sequence, num_samples: int, draws: list[SampledToken]
    ) -> list[EngineCoreOutput]:
        """A sampled token for ``seq`` of a multi-sequence request; at a fork
        (``num_samples > 1``, ``draws`` in sample order) the other draws start sequences 1.."""
        outputs: list[EngineCoreOutput] = []
        family = [seq]
        if num_samples > 1:
            family.extend(self._fan_out(request, seq, [t.token_id for t in draws[1:]]))
        for s, row in zip(family, draws, strict=False):
            token = row.token_id
            if s is seq:
                s.token_ids.append(token)
                if self._placeholders and s.seq_id in self._placeholders:  # (see _append_one)
                    self._placeholders.remove(s.seq_id)
                    self._pending.placeholder_values.append((s.seq_id, token))
            finished = check_stop(request, s, token)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    seq_id=s.seq_id,
                    completion=s.index,
                    new_token_ids=(token,),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    sampled=row,
                )
            )
            if finished:
                self._release(s)
        if seq.finish_reason is not None if len(request.seqs) == 1 else request.is_finished:
            self._finish(request)
            self.num_finished += 1
        return outputs

    def _verified(
        self, request: Request, seq: Sequence, num_draft: int, row: SampledToken
    ) -> EngineCoreOutput:
        """A speculative step's result: the accepted proposals then the target's token
        (``row.accepted`` then ``row.token_id``: 1 to ``num_draft + 1`` tokens), appended one
        by one under the stop rules. The kept proposals' K/V stay (they become computed
        tokens); the rejected slots roll back in the next transaction, and a sequence that
        finished is freed instead."""
        accepted = len(row.accepted)
        assert accepted <= num_draft, f"{accepted + 1} tokens for {num_draft} proposals"
        self.spec_stats.observe((num_draft,), (accepted,))
        if accepted:
            seq.spec_backoff = 0
        else:  # each wasted round doubles the pause before the next proposal (at most 16)
            self.back_off(seq, self.num_plans)
        appended = self._append_until_stop(request, seq, (*row.accepted, row.token_id))
        if not seq.is_finished:
            seq.num_computed_tokens += accepted
            self._pending.truncates.append((seq.seq_id, seq.num_computed_tokens))
        return EngineCoreOutput(
            request_id=request.request_id,
            seq_id=seq.seq_id,
            completion=seq.index,
            new_token_ids=appended,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            sampled=row,
        )

    def _beam_step(self, request: Request) -> None:
        """All beams reported: advance the search, fork, drop, or finish the request."""
        assert request.beam is not None
        choices = request.beam.step(request.beam_top)
        request.beam_top.clear()
        live = {s.seq_id: s for s in request.live_seqs}
        bases = {sid: list(s.token_ids) for sid, s in live.items()}
        kept: list[Sequence] = []
        for index, choice in enumerate(choices):
            parent = live[choice.parent]
            if all(s is not parent for s in kept):
                parent.token_ids.append(choice.token)
                parent.index = index
                kept.append(parent)
                continue
            child = Sequence(
                seq_id=self._new_seq_id(),
                index=index,
                token_ids=[*bases[parent.seq_id], choice.token],
                num_prompt_tokens=parent.num_prompt_tokens,
                num_computed_tokens=parent.num_computed_tokens,
                has_blocks=True,
            )
            self._pending.forks.append((parent.seq_id, child.seq_id))
            kept.append(child)
        for seq in live.values():
            if all(s is not seq for s in kept):
                seq.finish_reason = "stop"  # pruned beam
                self._release(seq)
        request.seqs = kept or list(live.values())
        if not request.beam.done:
            request.beam.assign([s.seq_id for s in kept])
        else:
            for seq in request.live_seqs:
                seq.finish_reason = "stop"
                self._release(seq)
            self.finished_beams.append((request.request_id, list(request.beam.finished)))
            self._finish(request)
            self.num_finished += 1

    def _fan_out(self, request: Request, seq: Sequence, tokens: SeqOf[int]) -> list[Sequence]:
        """Create sequences 1.. of a parallel-sampling request from its first sequence."""
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        children = []
        for index, (child_id, token) in enumerate(zip(request.fork_ids, tokens, strict=True), 1):
            child = Sequence(
                seq_id=child_id,
                index=index,
                token_ids=[*prompt, token],
                num_prompt_tokens=seq.num_prompt_tokens,
                num_computed_tokens=seq.num_computed_tokens,
                has_blocks=True,
            )
            request.seqs.append(child)
            self._pending.forks.append((seq.seq_id, child_id))
            children.append(child)
        return children

    def _append_until_stop(
        self, request: Request, seq: Sequence, tokens: SeqOf[int]
    ) -> tuple[int, ...]:
        """Append ``tokens`` one by one under the stop rules; the first that stops the sequence
        is the last appended, and the sequence is released. Returns what was appended."""
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if check_stop(request, seq, token):
                self._release(seq)
                return tuple(tokens[: i + 1])
        return tuple(tokens)

    def sample_is_discarded(self, seq_id: int) -> bool:
        """Whether the sample in flight for ``seq_id`` will be dropped (tokens a grammar forced
        come first: :meth:`append_forced`)."""
        return seq_id in self._discarded

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
        self._placeholders.discard(seq.seq_id)  # (its free drops the placeholder with the table)
        self._discarded.discard(seq.seq_id)
        if seq.has_blocks:
            seq.has_blocks = False
            self._pending.frees.append(seq.seq_id)

    def _finish(self, request: Request) -> None:
        """Drop a finished request from its queue; its blocks are freed by the next txn (after
        its prefix is pinned, if it was computing one to pin)."""
        del self.requests[request.request_id]
        if request.pin_id is not None and request.seqs[0].finish_reason != "abort":
            seq = request.seqs[0]
            prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
            pin = PinOp(pin_id=request.pin_id, token_ids=prompt, extra_key=request.cache_key)
            self._pending.pins.append(pin)
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
