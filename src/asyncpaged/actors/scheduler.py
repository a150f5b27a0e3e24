"""The scheduler actor: the step loop and the requests' lifecycle in the core.

The actor holds its state, loop, planning, messages, the taking of a finished step and the
stop-string check, and decides when a step's outputs go to the output processor
(``actors/output_processor.py``), which owns the requests' output states. It keeps a
:class:`SchedulerRequestState` record of each live request (:mod:`.request_state`) and owns
two classes of its own: a :class:`StepBuilder` (:mod:`.step_builder`: a step's ``SequenceStep``
rows and a step planned ahead's late inputs, with the sampling options of
:mod:`.sampling_options`) and ``pin_prefix``'s :class:`PinWaiters` (:mod:`.pin_waiters`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged._log import get_logger
from asyncpaged.actors.draft_proposals import DraftProposals
from asyncpaged.actors.idle import IdleSignal
from asyncpaged.actors.messages import (
    AbortRequest,
    AddRequest,
    CopyTierBlocks,
    DeliverLate,
    EndRequest,
    ExecuteStep,
    ExecutorInbox,
    ForgetPin,
    OutputsInbox,
    RecordOutputs,
    RequestInfo,
    Scheduled,
    SchedulerInbox,
    StepDone,
    StopsFound,
    SwapBlocks,
    SwapDone,
    SwapSpaceInbox,
    UnpinPrefix,
    WatchPin,
)
from asyncpaged.actors.pin_waiters import PinWaiters
from asyncpaged.actors.request_state import SchedulerRequestState
from asyncpaged.actors.sampling_options import bad_words_token_ids, banned_next_tokens
from asyncpaged.actors.step_builder import LateRows, StepBuilder, seq_of
from asyncpaged.actors.thinking_budget import ThinkingBudget
from asyncpaged.errors import NoTokenAllowedError, RequestFailedError
from asyncpaged.kv.tiers import TierOp
from asyncpaged.kv.txn import PoolSnapshot, StepTxn, TxnResult
from asyncpaged.reasoning import ReasoningMarkers
from asyncpaged.sampled_token import SampledToken
from asyncpaged.sched.request import Request, RequestStatus
from asyncpaged.sched.scheduler import (
    EngineCoreOutput,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    SchedulerStatistics,
)
from asyncpaged.streams import RequestState
from asyncpaged.structured_outputs import GrammarBackend
from asyncpaged.worker.protocol import PromptLogprobRows, StepPlan

__all__ = ["SchedulerActor", "bad_words_token_ids", "banned_next_tokens"]

log = get_logger(__name__)


class SchedulerActor:
    """Owns the request queues (the :class:`Scheduler` core) and its own record of each live request
    (:class:`SchedulerRequestState`: the intake's ``RequestInfo``, grammar matchers, prompt-logprob
    progress); it never sees a request's output state.

    Loop: handle every message that has arrived; if the last step had tokens of requests with
    stop strings, send them to the output processor and wait for its verdict (a stop string
    ends its sequence before the next plan, so no step computes past it); when no step is in
    flight and there is work, plan a step, get the allocator's transaction result, start the
    swaps and send the step to the executor; then send the last step's other outputs to the
    output processor (after the transaction that freed what finished), and wait for the next
    message. Inboxes: its own is unbounded because every message in it stands for accepted
    work (one add and at most one abort per request, one step, one completion per swap); it
    never blocks on its outboxes (one transaction and one step at a time; the swap outbox is
    sized for every swap that can be in flight; the output processor's is unbounded, and
    answers a stop check without waiting on anything).

    Invariant: ``_states`` holds exactly the requests the core holds (added, not finished).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        snapshot: PoolSnapshot,
        inbox: MemoryObjectReceiveStream[SchedulerInbox],
        txns: MemoryObjectSendStream[StepTxn],
        results: MemoryObjectReceiveStream[TxnResult],
        executor: MemoryObjectSendStream[ExecutorInbox],
        swaps: MemoryObjectSendStream[SwapSpaceInbox],
        outputs: MemoryObjectSendStream[OutputsInbox],
        stop_replies: MemoryObjectReceiveStream[StopsFound],
        eos_token_ids: frozenset[int],
        tokenizer: Any = None,
        grammars: GrammarBackend | None = None,
        *,
        draft_proposals: DraftProposals | None = None,
        async_scheduling: bool = False,
        reasoning: ReasoningMarkers | None = None,
    ) -> None:
        """``draft_proposals``: the draft model's proposals (speculative method
        "draft_model"), refilled from every step's result for the core's proposer;
        ``tokenizer``: the loop's, for bad words; ``async_scheduling``: plan a step while the
        one before runs, where its requests allow (:meth:`_plans_ahead`); ``reasoning``: the
        engine's reasoning markers, for thinking budgets (``actors/thinking_budget.py``)."""
        self.scheduler = scheduler
        self._reasoning = reasoning
        self._draft_proposals = draft_proposals
        self._grammars = grammars
        self.snapshot = snapshot
        self._states: dict[str, SchedulerRequestState] = {}
        self._steps = StepBuilder(
            scheduler, self._states, eos_token_ids=eos_token_ids, tokenizer=tokenizer,
            grammars=grammars, has_draft_model=draft_proposals is not None,
        )  # fmt: skip
        self._inbox = inbox
        self._outputs = outputs
        self._stop_replies = stop_replies
        self._txns = txns
        self._results = results
        self._executor = executor
        self._swaps = swaps
        self._eos = eos_token_ids
        self._async = async_scheduling
        # Steps sent and not yet done, oldest first: one, or two when the second was planned
        # ahead (async scheduling)
        self._in_flight: deque[SchedulerOutput] = deque()
        # ``executed`` of the last step sent: when a plan is made ahead, the step in flight
        self._last_executed: anyio.Event | None = None
        # the late rows of the step planned ahead: their sampling inputs go to the executor
        # once the step before it is back (``late_inputs``)
        self._late_due: LateRows = ()
        self._late_back = False  # the step before the one they belong to is back
        self._planning = False  # a transaction is at the allocator
        self._idle = IdleSignal(lambda: self.is_idle)
        self._log = log.bind(actor="scheduler")
        self.num_steps = 0
        self.step_time_s = 0.0
        self.compute_time_s = 0.0
        self.num_jump_forward_tokens = 0  # tokens a grammar forced, appended without sampling
        self.num_thinking_forced_tokens = 0  # end-marker tokens a thinking budget appended
        self.num_steps_ahead = 0  # steps planned while the one before ran (async scheduling)
        self.num_steps_graphed = 0  # steps whose forward replayed a CUDA graph
        self._pins = PinWaiters(scheduler, self._log)  # engine.pin_prefix's waiters (WatchPin)
        # Requests submitted and not yet added here nor released by the intake (refused,
        # aborted there): the engine counts them in (expect_request), so idle waits for them.
        self.num_incoming = 0
        # States of streams dropped unfinished (their finalizer, maybe on another thread, only
        # appends here: deque.append is atomic); their requests (id and serial, nothing else
        # is read) are aborted at the top of the next loop.
        self.dropped: deque[RequestState] = deque()
        # The last step's outputs: the tokens of requests with stop strings, checked before
        # the next plan (_check_stops); the rest, sent after the next step (_deliver).
        self._stop_tokens: list[EngineCoreOutput] = []
        self._tokens: list[EngineCoreOutput] = []
        self._prompt_logprobs: list[tuple[str, PromptLogprobRows]] = []
        self._scheduled: list[Scheduled] = []
        self._beams: list[tuple[str, tuple[tuple[tuple[int, ...], float, bool], ...]]] = []
        self._release_due = False  # a stop check held states: the next delivery releases them

    # ---- queries ----------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        return self.scheduler.statistics()

    @property
    def num_lora_loads(self) -> int:
        """LoRA adapters put into a device slot so far."""
        return self._steps.num_lora_loads

    @property
    def num_request_states(self) -> int:
        """Requests this actor keeps a record of (the core's live requests)."""
        return len(self._states)

    @property
    def is_idle(self) -> bool:
        sched = self.scheduler
        return not (
            self.num_incoming or self._in_flight or self._planning or self._pins
            or self._stop_tokens or self._tokens or self._prompt_logprobs or self._scheduled
            or self._beams or self._release_due
            or sched.has_unfinished
            or sched.has_swaps_in_flight or sched.has_pending_txn_work
        )  # fmt: skip

    async def wait_idle(self) -> None:
        """Wait until no request (in intake included), step, swap or pending free is left.
        Any number of tasks may wait (``IdleSignal``)."""
        await self._idle.wait()

    def expect_request(self) -> None:
        """The engine queued a request for the intake (counted until added or released)."""
        self.num_incoming += 1

    def intake_released(self) -> None:
        """The intake refused or aborted a request: it will never be added here."""
        self.num_incoming -= 1
        self._idle.notify()

    # ---- the loop ---------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with (
            self._inbox, self._txns, self._results, self._executor, self._swaps, self._outputs,
            self._stop_replies,
        ):  # fmt: skip
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
                if self._stop_tokens:
                    await self._check_stops()
                stepped = False
                if not self._in_flight:
                    if self._has_work():
                        stepped = await self._step()
                elif self._plans_ahead():
                    stepped = await self._step(self._in_flight[0])
                elif self._async and self.scheduler.can_flush:
                    await self._flush()  # a finished request's blocks return now
                self._deliver()  # the last step's outputs, while the next one runs
                self._idle.notify()
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

    async def _copy_tiers(self, ops: tuple[TierOp, ...], ahead: bool) -> None:
        """Run a transaction's KV-tier copies (swap-space actor's thread) and wait for them:
        the step reads restored blocks and writes over offloaded ones. Planned ``ahead`` of the
        step in flight, they wait for it first: a block it writes may have been freed since
        (a request aborted, or ended by that step's token) and be offloaded or restored into
        now. Cancelled midway (only at shutdown), the copies still finish in their thread."""
        if ahead:
            assert self._last_executed is not None, "a plan ahead of no step"
            await self._last_executed.wait()
        done = anyio.Event()
        self._swaps.send_nowait(CopyTierBlocks(ops=ops, done=done))
        await done.wait()

    def _plans_ahead(self) -> bool:
        """Async scheduling: whether to plan the next step now, while the one in flight runs: the
        core allows it (:meth:`Scheduler.can_plan_ahead`, and the last plan was not cut short),
        there is work, and every request the step in flight samples for may decode a token it has
        not seen (``SchedulerRequestState.ahead``: no beams; what its sampling reads of that token
        comes late: ``StepBuilder.late_inputs``; one at its fork sits the plan out), and none
        verifies or is due to make speculative proposals."""
        if not self._async or len(self._in_flight) != 1 or not self._has_work():
            return False
        sched = self.scheduler
        if sched.planned_cut or not sched.can_plan_ahead():
            return False
        states = self._states
        for s in self._in_flight[0].seqs:
            t = states.get(s.request_id) if s.samples else None
            if t is None:
                continue
            if not t.ahead:  # (a request at its fork sits the plan ahead out: the core)
                return False
            if t.speculates and (s.num_draft or self._proposes_next(s)):
                return False
        return True

    def _proposes_next(self, s: ScheduledSeq) -> bool:
        """Speculative decoding: whether the sequence that ``s`` samples for proposes in its
        next decode, which needs the token in flight (then the next plan waits for it).
        A step with proposals is never planned ahead of: where its sequences' next rows
        start depends on how many proposals it keeps."""
        request = self.scheduler.requests.get(s.request_id)
        if request is None:  # (ended meanwhile: no row)
            return False
        seq = seq_of(request, s.seq_id)
        return not seq.is_finished and self.scheduler.next_proposals(request, seq) > 0

    async def _flush(self) -> None:
        """A transaction of the pending frees, placeholders, forks, pins and swap
        confirmations alone, while a step runs that the next cannot be planned ahead of."""
        self._planning = True
        await self._txns.send(self.scheduler.plan_flush())
        result = await self._results.receive()
        self._planning = False
        self.snapshot = result.snapshot
        self._pins.hand_out(result.pinned)

    async def _step(self, ahead: SchedulerOutput | None = None) -> bool:
        """Plan and start one step (``ahead`` of the step in flight: see
        :meth:`Scheduler.plan`); False if it ran nothing (then wait for news)."""
        txn = self.scheduler.plan(self.snapshot, ahead)
        self._planning = True
        await self._txns.send(txn)
        result = await self._results.receive()
        self._planning = False
        self.snapshot = result.snapshot
        if result.tier_ops:
            await self._copy_tiers(result.tier_ops, ahead is not None)
        self._pins.hand_out(result.pinned)
        out = self.scheduler.apply(txn, result)
        for plan in (*out.swap_outs, *out.swap_ins):
            self._swaps.send_nowait(SwapBlocks(plan=plan))
        for rid in out.preempted:
            self._log.info("request_preempted", request_id=rid)
        if not out.seqs:  # it changed something the next plan may use, or nothing
            return bool(txn.frees or txn.complete_swaps or out.preempted)
        steps, scheduled, late = self._steps.build(out)
        self._scheduled.extend(scheduled)
        self._in_flight.append(out)
        executed = self._last_executed = anyio.Event()
        self.num_steps_ahead += ahead is not None
        # Without a checkpoint (the executor's inbox has room: it takes each step as it comes,
        # and at most two are in flight), so the executor is the first task to run and starts
        # the step (or queues it behind the running one) before the outputs are recorded.
        if late:  # their inputs go once the step in flight is back (_send_late sends them)
            assert not self._late_due, "the late inputs of the step in flight not sent"
            self._late_due = late
        step = StepPlan(seqs=tuple(steps), copy_pairs=out.copy_on_write,
                        late_rows=tuple(seq_id for _, seq_id, _ in late),
                        lora_loads=self._steps.lora_loads)  # fmt: skip
        self._executor.send_nowait(ExecuteStep(output=out, plan=step, executed=executed))
        self._steps.sent()
        return True

    # ---- a finished step --------------------------------------------------------------------

    def _finish_step(self, out: SchedulerOutput, sampled: Sequence[SampledToken]) -> None:
        """A step's results, the part the next plan depends on: the scheduler's appends and
        stop rules, failed rows, grammar matchers and jump-forward; the late inputs of the
        step in flight (then, or after :meth:`_check_stops`). The tokens of requests with stop
        strings wait for :meth:`_check_stops` (before the next plan), the others for
        :meth:`_deliver` (after the next step is sent, while its forward runs)."""
        failed = [t for t in sampled if t.error is not None]
        for rid, error in self._failed_requests(out, failed):
            self._end(rid, error)
        outputs = self.scheduler.update(out, sampled)
        if self._draft_proposals is not None:
            self._draft_proposals.record(out.seqs, sampled)
        ended: list[str] = []
        for output in outputs:
            upd = output
            states = self._states[upd.request_id]
            if states.matchers:
                if not states.accept_grammar_tokens(upd.completion, upd.new_token_ids):
                    self._log.warning("grammar_rejected_token", request_id=upd.request_id,
                                      tokens=list(upd.new_token_ids))  # fmt: skip
                stops, reason = states.grammar_stop(upd, self._eos)
                if stops:
                    self.scheduler.finish_seq(upd.request_id, upd.seq_id, "stop", reason)
                    upd = upd._replace(finish_reason="stop", stop_reason=reason)
                # + the tokens the grammar forces
                upd, num_forced = self._jump_forward(states, upd)
                self.num_jump_forward_tokens += num_forced
            if states.thinking is not None:
                upd = self._end_thinking(states.thinking, upd)
            if states.info.params.stop:
                self._stop_tokens.append(upd)
            else:
                self._tokens.append(upd)
                if upd.finish_reason is not None:
                    ended.append(upd.request_id)
        for rid in ended:  # once all its completions' updates are taken
            self._forget_if_gone(rid)
        # the step in flight samples rows whose inputs read this step's tokens: they are
        # made now, or once the stop check knows which sequences a stop string ended
        self._late_back = bool(self._late_due)
        if not self._stop_tokens:
            self._send_late()
        eos = self._eos
        for rid, hypotheses in self.scheduler.finished_beams:
            self._beams.append((rid, tuple((tuple(h.tokens), h.logprob, h.tokens[-1] in eos)
                                           for h in hypotheses)))  # fmt: skip
            self._states.pop(rid, None)
        self.scheduler.finished_beams.clear()

    def _failed_requests(
        self, out: SchedulerOutput, failed: list[SampledToken]
    ) -> list[tuple[str, RequestFailedError]]:
        """Rows whose logits processor raised, or whose constraints allowed no token: each
        such request is aborted in the core (its blocks are freed by the next transaction) and
        fails alone; returns them with the error their waiters get."""
        if not failed:
            return []
        owner = {s.seq_id: s.request_id for s in out.seqs}
        ended = []
        for token in failed:
            rid = owner[token.seq_id]
            if self.scheduler.abort(rid) is None:
                continue  # another row of it failed first
            why = (
                "its constraints allowed no token"
                if isinstance(token.error, NoTokenAllowedError)
                else "its logits processor raised"
            )
            error = RequestFailedError(f"request {rid!r}: {why}")
            error.__cause__ = token.error
            ended.append((rid, error))
            self._log.info("request_failed", request_id=rid, error=repr(token.error))
        return ended

    def _jump_forward(
        self, states: SchedulerRequestState, upd: EngineCoreOutput
    ) -> tuple[EngineCoreOutput, int]:
        """Structured outputs' jump-forward: after a sampled token, append the tokens the
        grammar forces next (``EngineConfig.structured_outputs_jump_forward``); the next step
        computes them as a chunk. Not for requests that report logprobs (a forced token's
        logprob is never computed) or rank by them (best_of). Returns the output with them and
        their number."""
        grammars, info = self._grammars, states.info
        matcher = states.matchers.get(upd.completion)
        if (
            matcher is None or grammars is None or not grammars.jump_forward
            or upd.finish_reason is not None or info.params.logprobs is not None
            or info.ranks_by_logprob
        ):  # fmt: skip
            return upd, 0
        forced = grammars.jump_forward_tokens(matcher)
        if not forced:
            return upd, 0
        appended, reason, stop = self.scheduler.append_forced(upd.request_id, upd.seq_id, forced)
        return upd._replace(new_token_ids=upd.new_token_ids + appended,
                            finish_reason=reason, stop_reason=stop), len(appended)  # fmt: skip

    def _end_thinking(self, thinking: ThinkingBudget, upd: EngineCoreOutput) -> EngineCoreOutput:
        """A thinking budget: append the end marker after the token that spends it
        (``append_forced``, as jump-forward does; the next step computes it as a chunk), and
        report a marker appended when the request was added before the completion's first
        sampled token (:meth:`_start_thinking_budget`)."""
        forced = thinking.forced_after(upd.completion, upd.new_token_ids)
        if forced and upd.finish_reason is None:
            appended, reason, stop = self.scheduler.append_forced(
                upd.request_id, upd.seq_id, forced
            )
            self.num_thinking_forced_tokens += len(appended)
            upd = upd._replace(new_token_ids=upd.new_token_ids + appended,
                               finish_reason=reason, stop_reason=stop)  # fmt: skip
        prefix = thinking.reported_prefix(upd.completion)
        if prefix:
            upd = upd._replace(new_token_ids=prefix + upd.new_token_ids)
        return upd

    def _start_thinking_budget(self, request: Request, info: RequestInfo) -> ThinkingBudget | None:
        """A new request's thinking budget (None: it has none). A budget of 0 on a prompt
        that opened the thinking appends the end marker to the new sequence now, so the first
        step computes it after the prompt and samples the answer; it is reported with the first
        sampled token (:meth:`_end_thinking`). Where it cannot go first (``n``/``best_of`` > 1,
        a ``max_tokens`` it does not fit in, an id of it that stops the sequence), the first
        sampled token spends the budget and the marker follows it."""
        budget = info.params.thinking_token_budget
        if budget is None:
            return None
        markers = self._reasoning
        assert markers is not None, "a thinking budget on an engine without a reasoning parser"
        stop, end = request.stop, markers.end_ids
        # (not before a fork: the core forks a parallel-sampling request's sequences from
        # its prompt alone, at its first sampled token)
        can_lead = (
            request.num_samples == 1
            and stop.max_tokens > len(end)
            and not set(end) & (stop.stop_token_ids | stop.eos_token_ids)
        )
        thinking = ThinkingBudget(markers, budget, in_reasoning=info.in_reasoning_at_start,
                                  can_lead=can_lead)  # fmt: skip
        if thinking.forced_first:
            seq = request.seqs[0]
            appended, reason, _ = self.scheduler.append_forced(
                request.request_id, seq.seq_id, thinking.forced_first
            )
            assert reason is None, "the end marker stopped the sequence (can_lead)"
            self.num_thinking_forced_tokens += len(appended)
        return thinking

    def _prompt_logprob_progress(
        self, out: SchedulerOutput, rows: tuple[PromptLogprobRows, ...]
    ) -> list[tuple[str, PromptLogprobRows]]:
        """The step's prompt logprobs by request (for the output processor), counted into each
        request's ``prompt_known``; a request whose prompt logprobs are complete reads the
        prefix cache again."""
        if not rows:
            return []
        owner = {s.seq_id: s.request_id for s in out.seqs}
        by_request = []
        for chunk in rows:
            rid = owner[chunk.seq_id]
            t = self._states.get(rid)
            if t is None or t.prompt_known is None:
                continue  # aborted or failed meanwhile
            by_request.append((rid, chunk))
            t.prompt_known = max(t.prompt_known, chunk.first_position + len(chunk.token_ids))
            request = self.scheduler.requests.get(rid)
            if t.prompt_known >= len(t.info.prompt_token_ids) and request is not None:
                request.read_prefix_cache = True
        return by_request

    async def _check_stops(self) -> None:
        """The last step's tokens of requests with stop strings, to the output processor,
        which records them (held from their readers until the next delivery) and answers
        which sequences a stop string ended; those end here, before the next plan. Cancelled
        midway (the actor's task cancelled), nothing is undone: the output processor may hold
        the tokens recorded."""
        tokens, self._stop_tokens = self._stop_tokens, []
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, []
        self._outputs.send_nowait(RecordOutputs(tokens=tuple(tokens),
                                                prompt_logprobs=tuple(prompt_logprobs),
                                                check_stops=True))  # fmt: skip
        self._release_due = True
        verdict = await self._stop_replies.receive()
        for rid, seq_id, matched in verdict.matches:
            self.scheduler.finish_seq(rid, seq_id, "stop", matched)
        for token in tokens:
            self._forget_if_gone(token.request_id)
        self._send_late()

    def _forget_if_gone(self, request_id: str) -> None:
        if request_id not in self.scheduler.requests:
            self._states.pop(request_id, None)

    def _send_late(self) -> None:
        """The late inputs of the step in flight (``StepBuilder.late_inputs``), once the step
        before it is back and its stop strings checked (a sequence one ended samples for nothing
        and plain, so no logits processor sees a row the sync engine never computes)."""
        if not self._late_back:
            return
        due, self._late_due, self._late_back = self._late_due, (), False
        self._executor.send_nowait(DeliverLate(delivery=self._steps.late_inputs(due)))

    # ---- messages ---------------------------------------------------------------------------

    def _handle(self, msg: SchedulerInbox) -> None:
        match msg:
            case AddRequest(request=request, info=info):
                self.num_incoming -= 1
                rid = request.request_id
                params = info.params
                known = None if params.prompt_logprobs is None else 1
                self._states[rid] = SchedulerRequestState(
                    info=info, prompt_known=known, ahead=self._async and request.beam is None,
                    speculates=request.num_speculative_tokens > 0,
                )  # fmt: skip
                self.scheduler.add_request(request)
                self._states[rid].thinking = self._start_thinking_budget(request, info)
                self._log.debug("request_added", request_id=rid)
            case AbortRequest(request_id=rid, serial=serial):
                states = self._states.get(rid)
                if states is None or states.info.serial != serial:
                    return  # still in intake (which drops it), or already finished
                if self.scheduler.abort(rid) is not None:
                    self._end(rid, None)
                    self._log.info("request_aborted", request_id=rid)
            case StepDone(step_id=step_id, result=result, duration_s=duration):
                out = self._in_flight.popleft()
                assert out.step_id == step_id
                self.num_steps += 1
                self.step_time_s += duration
                self.compute_time_s += result.compute_s
                self.num_steps_graphed += result.cuda_graph
                self._prompt_logprobs.extend(
                    self._prompt_logprob_progress(out, result.prompt_logprobs)
                )
                self._finish_step(out, result.sampled)
            case SwapDone(swap_id=swap_id):
                self.scheduler.complete_swap(swap_id)
            case WatchPin(pin_id=pin_id, event=event, slot=slot):
                self._pins.watch(pin_id, event, slot)
            case ForgetPin(pin_id=pin_id, slot=slot):
                self._pins.forget(pin_id, slot)
            case UnpinPrefix(pool_pin_id=pool_pin_id, handled=handled):
                self.scheduler.unpin(pool_pin_id)
                self._log.info("prefix_unpinned", pool_pin_id=pool_pin_id)
                handled.set()

    def _abort_dropped(self, state: RequestState) -> None:
        """A stream was dropped unfinished: abort its request if it is here (in intake, its
        ``abort_requested`` flag is enough)."""
        self._handle(AbortRequest(request_id=state.request_id, serial=state.serial))

    def _end(self, request_id: str, error: BaseException | None) -> None:
        """The core ended a request outside its outputs (aborted, failed alone)."""
        del self._states[request_id]
        self._outputs.send_nowait(EndRequest(request_id=request_id, error=error))

    def _deliver(self) -> None:
        """Send the last step's other outputs to the output processor (which records them,
        releases what the stop check held and wakes the readers)."""
        if not (self._tokens or self._prompt_logprobs or self._scheduled or self._beams
                or self._release_due):  # fmt: skip
            return
        msg = RecordOutputs(tokens=tuple(self._tokens),
                            prompt_logprobs=tuple(self._prompt_logprobs),
                            scheduled=tuple(self._scheduled), beams=tuple(self._beams))  # fmt: skip
        self._tokens, self._prompt_logprobs, self._scheduled, self._beams = [], [], [], []
        self._release_due = False
        self._outputs.send_nowait(msg)
