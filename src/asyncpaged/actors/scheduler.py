"""The scheduler actor: the step loop, request lifecycle and output streaming.

Its parts live beside it: building a step's ``SequenceStep`` rows (:mod:`.scheduler_steps`,
with the sampling options of :mod:`.scheduler_sampling`), recording a step's results into the
requests' states (:mod:`.scheduler_outputs`), and ``pin_prefix``'s waiters
(:mod:`.scheduler_pins`). This module keeps the actor: its loop, its messages, and when a step's
outputs are recorded and their readers woken."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged._log import get_logger
from asyncpaged.actors.scheduler_outputs import (
    accept_grammar_tokens,
    fail_requests_of,
    jump_forward,
    record_prompt_logprobs,
    record_tokens,
    tokens_by_seq,
)
from asyncpaged.actors.scheduler_pins import PinWaiters, hand_out_pins
from asyncpaged.actors.scheduler_sampling import (
    BadWordsCache,
    bad_words_token_ids,
    banned_next_tokens,
)
from asyncpaged.actors.scheduler_steps import build_sequence_steps
from asyncpaged.core.beam_search import Hypothesis
from asyncpaged.core.kv_tiers import TierOp
from asyncpaged.core.request import RequestStatus
from asyncpaged.core.scheduler import (
    Scheduler,
    SchedulerOutput,
    SchedulerStatistics,
    SeqUpdate,
)
from asyncpaged.core.txn import PoolSnapshot, StepTxn, TxnResult
from asyncpaged.messages import (
    AbortRequest,
    AddRequest,
    CopyTierBlocks,
    ExecuteStep,
    ForgetPin,
    SchedulerInbox,
    StepDone,
    SwapBlocks,
    SwapDone,
    SwapSpaceInbox,
    UnpinPrefix,
    WatchPin,
)
from asyncpaged.model.block_tables import TableDeltas
from asyncpaged.model.draft import DraftProposals
from asyncpaged.model.runner import SampledToken, StepPlan
from asyncpaged.streams import RequestState
from asyncpaged.structured_outputs import GrammarBackend

__all__ = ["SchedulerActor", "bad_words_token_ids", "banned_next_tokens"]

log = get_logger(__name__)


class SchedulerActor:
    """Owns the request queues (the :class:`Scheduler` core) and every request's output state.

    Loop: handle every message that has arrived; when no step is in flight and there is work,
    plan a step, get the allocator's transaction result, start the swaps and send the step to
    the executor; then wait for the next message. Inboxes: its own is unbounded because every
    message in it stands for accepted work (one add and at most one abort per request, one
    step, one completion per swap); it never blocks on its outboxes (one transaction and one
    step at a time; the swap outbox is sized for every swap that can be in flight).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        snapshot: PoolSnapshot,
        inbox: MemoryObjectReceiveStream[SchedulerInbox],
        txns: MemoryObjectSendStream[StepTxn],
        results: MemoryObjectReceiveStream[TxnResult],
        executor: MemoryObjectSendStream[ExecuteStep],
        swaps: MemoryObjectSendStream[SwapSpaceInbox],
        eos_token_ids: frozenset[int],
        tokenizer: Any = None,
        grammars: GrammarBackend | None = None,
        *,
        draft_proposals: DraftProposals | None = None,
    ) -> None:
        """``draft_proposals``: the draft model's proposals (speculative method
        "draft_model"), refilled from every step's result for the core's proposer."""
        self.scheduler = scheduler
        self._draft_proposals = draft_proposals
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._bad_words = BadWordsCache(tokenizer)
        self.snapshot = snapshot
        self.states: dict[str, RequestState] = {}
        self._inbox = inbox
        self._txns = txns
        self._results = results
        self._executor = executor
        self._swaps = swaps
        self._eos = eos_token_ids
        self._in_flight: SchedulerOutput | None = None
        self._tables = TableDeltas()  # the block tables the executor's runner holds
        self._planning = False  # a transaction is at the allocator
        self._idle = anyio.Event()
        self._log = log.bind(actor="scheduler")
        self.num_steps = 0
        self.step_time_s = 0.0
        self.compute_time_s = 0.0
        self.num_jump_forward_tokens = 0  # tokens a grammar forced, appended without sampling
        # engine.pin_prefix waiters (WatchPin): pin id -> (event, what the pool pinned)
        self._pins: PinWaiters = {}
        # Requests submitted and not yet added here nor released by the intake (refused,
        # aborted there): the engine counts them in (expect_request), so idle waits for them.
        self.num_incoming = 0
        # States of streams dropped unfinished (their finalizer, maybe on another thread, only
        # appends here: deque.append is atomic); aborted at the top of the next loop.
        self.dropped: deque[RequestState] = deque()
        # A step's outputs recorded after the next step is sent (_deliver): (state, update,
        # token) to record, held states to release, finished beam searches.
        self._to_record: list[tuple[RequestState, SeqUpdate, SampledToken]] = []
        self._to_release: list[RequestState] = []
        self._beams_done: list[tuple[str, list[Hypothesis]]] = []

    # ---- queries ----------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        return self.scheduler.statistics()

    @property
    def is_idle(self) -> bool:
        sched = self.scheduler
        return not (
            self.num_incoming or self._in_flight or self._planning or self._pins
            or self._to_record or self._to_release or self._beams_done
            or sched.has_unfinished
            or sched.has_swaps_in_flight or sched.has_pending_txn_work
        )  # fmt: skip

    async def wait_idle(self) -> None:
        """Wait until no request (in intake included), step, swap or pending free is left.
        Any number of tasks may wait: a new event replaces only one that was already set, so
        every waiter waits on the event the loop sets next."""
        while not self.is_idle:
            if self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    def expect_request(self) -> None:
        """The engine queued a request for the intake (counted until added or released)."""
        self.num_incoming += 1

    def intake_released(self) -> None:
        """The intake refused or aborted a request: it will never be added here."""
        self.num_incoming -= 1
        if self.is_idle:
            self._idle.set()

    # ---- the loop ---------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox, self._txns, self._results, self._executor, self._swaps:
            while True:
                while self.dropped:
                    self._abort_dropped(self.dropped.popleft())
                while True:  # everything that has already arrived
                    try:
                        self._handle(self._inbox.receive_nowait())
                    except anyio.WouldBlock:
                        break
                    except anyio.EndOfStream:
                        self._deliver()
                        return
                stepped = False
                if self._in_flight is None and self._has_work():
                    stepped = await self._step()
                self._deliver()  # the last step's outputs, while the next one runs
                if self.is_idle:
                    self._idle.set()
                if not stepped:
                    try:
                        self._handle(await self._inbox.receive())
                    except anyio.EndOfStream:
                        self._deliver()
                        return

    def _has_work(self) -> bool:
        sched = self.scheduler
        return (
            sched.has_pending_txn_work
            or bool(sched.running or sched.waiting)
            or any(r.status is RequestStatus.SWAPPED for r in sched.swapped)
        )

    async def _copy_tiers(self, ops: tuple[TierOp, ...]) -> None:
        """Run a transaction's KV-tier copies (swap-space actor's thread) and wait for them:
        the step reads restored blocks and writes over offloaded ones. Cancelled midway (only
        at shutdown), the copies still finish in their thread."""
        done = anyio.Event()
        self._swaps.send_nowait(CopyTierBlocks(ops=ops, done=done))
        await done.wait()

    async def _step(self) -> bool:
        """Plan and start one step; False if it ran nothing (then wait for news)."""
        txn = self.scheduler.plan(self.snapshot)
        self._planning = True
        await self._txns.send(txn)
        result = await self._results.receive()
        self._planning = False
        self.snapshot = result.snapshot
        if result.tier_ops:
            await self._copy_tiers(result.tier_ops)
        hand_out_pins(result.pinned, self._pins, self.scheduler, self._log)
        out = self.scheduler.apply(txn, result)
        for plan in (*out.swap_outs, *out.swap_ins):
            self._swaps.send_nowait(SwapBlocks(plan=plan))
        for rid in out.preempted:
            self._log.info("request_preempted", request_id=rid)
        if not out.seqs:  # it changed something the next plan may use, or nothing
            return bool(txn.frees or txn.complete_swaps or out.preempted)
        steps = build_sequence_steps(
            out,
            self.scheduler,
            self.states,
            eos_token_ids=self._eos,
            bad_words=self._bad_words,
            grammars=self._grammars,
            has_draft_model=self._draft_proposals is not None,
            tables=self._tables,
        )
        self._in_flight = out
        await self._executor.send(
            ExecuteStep(output=out, plan=StepPlan(seqs=tuple(steps), copy_pairs=out.copy_on_write))
        )
        self._tables.sent()
        return True

    # ---- messages ---------------------------------------------------------------------------

    def _handle(self, msg: SchedulerInbox) -> None:
        match msg:
            case AddRequest(request=request, state=state):
                self.num_incoming -= 1
                self.states[request.request_id] = state
                self.scheduler.add_request(request)
                self._log.debug("request_added", request_id=request.request_id)
            case AbortRequest(request_id=rid, state=aborted):
                if aborted is not None and self.states.get(rid) is not aborted:
                    return  # still in intake (which drops it), or already finished
                if self.scheduler.abort(rid) is not None:
                    self.states.pop(rid).abort()
                    self._log.info("request_aborted", request_id=rid)
            case StepDone(step_id=step_id, result=result, duration_s=duration):
                out = self._in_flight
                assert out is not None
                assert out.step_id == step_id
                self._in_flight = None
                self.num_steps += 1
                self.step_time_s += duration
                self.compute_time_s += result.compute_s
                record_prompt_logprobs(out, result.prompt_logprobs, self.scheduler, self.states,
                                       self._tokenizer)  # fmt: skip
                self._finish_step(out, result.sampled)
            case SwapDone(swap_id=swap_id):
                self.scheduler.complete_swap(swap_id)
            case WatchPin(pin_id=pin_id, event=event, slot=slot):
                self._pins[pin_id] = (event, slot)
            case ForgetPin(pin_id=pin_id):
                self._pins.pop(pin_id, None)
            case UnpinPrefix(pool_pin_id=pool_pin_id, handled=handled):
                self.scheduler.unpin(pool_pin_id)
                self._log.info("prefix_unpinned", pool_pin_id=pool_pin_id)
                handled.set()

    def _abort_dropped(self, state: RequestState) -> None:
        """A stream was dropped unfinished: abort its request if it is here (in intake, its
        ``abort_requested`` flag is enough)."""
        if self.states.get(state.request_id) is state:
            self._handle(AbortRequest(request_id=state.request_id, state=state))

    def _finish_step(self, out: SchedulerOutput, sampled: Iterable[SampledToken]) -> None:
        """A step's results, the part the next plan depends on: the scheduler's appends and
        stop rules, failed rows, grammar matchers and jump-forward, and the text of requests
        with stop strings (a stop string ends its sequence before the next plan, so no step
        computes past it). Everything else is recorded into the requests' states by
        :meth:`_deliver`, after the next step is sent, while its forward runs; a request
        detokenized here is held until then, so no reader sees a finish before its blocks are
        freed by the next transaction."""
        sampled = list(sampled)
        failed = [t for t in sampled if t.error is not None]
        fail_requests_of(out, failed, self.scheduler, self.states, self._log)
        by_row, tokens, top = tokens_by_seq(sampled)
        updates = self.scheduler.update(out, tokens, top)
        if self._draft_proposals is not None:
            self._draft_proposals.record(out.seqs, sampled)
        for update in updates:
            state = self.states[update.request_id]
            upd = update
            if state.matchers:
                if not accept_grammar_tokens(state, upd.completion, upd.new_token_ids):
                    self._log.warning("grammar_rejected_token", request_id=upd.request_id,
                                      tokens=list(upd.new_token_ids))  # fmt: skip
                # + the tokens the grammar forces
                upd, num_forced = jump_forward(state, upd, self.scheduler, self._grammars)
                self.num_jump_forward_tokens += num_forced
            if state.params.stop:
                state.hold()
                if record_tokens(state, upd, by_row[upd.row], self.scheduler, self._tokenizer):
                    self._log_if_finished(upd.request_id, state)
                self._to_release.append(state)
            else:
                self._to_record.append((state, upd, by_row[upd.row]))
        self._beams_done.extend(self.scheduler.finished_beams)
        self.scheduler.finished_beams.clear()

    def _deliver(self) -> None:
        """Record the last step's outputs (detokenize, logprobs) and wake their readers."""
        to_record, self._to_record = self._to_record, []
        scheduler, tokenizer = self.scheduler, self._tokenizer
        for state, upd, token in to_record:
            if record_tokens(state, upd, token, scheduler, tokenizer):
                self._log_if_finished(upd.request_id, state)
        to_release, self._to_release = self._to_release, []
        for state in to_release:
            state.release()
        beams, self._beams_done = self._beams_done, []
        for rid, hypotheses in beams:
            state = self.states[rid]
            eos = self._eos
            state.finish_beams(
                [(list(h.tokens), h.logprob, h.tokens[-1] in eos) for h in hypotheses],
                self._tokenizer,
            )
            self._log_if_finished(rid, state)

    def _log_if_finished(self, request_id: str, state: RequestState) -> None:
        if state.finished and request_id in self.states:
            del self.states[request_id]
            self._log.info(
                "request_finished",
                request_id=request_id,
                finish_reasons=[c.finish_reason for c in state.completions],
                num_tokens=sum(len(c.token_ids) for c in state.completions),
            )
