"""The scheduler actor: the step loop, request lifecycle and output streaming."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged._log import get_logger
from asyncpaged.core.beam_search import Hypothesis
from asyncpaged.core.block_table import PinnedPrefix
from asyncpaged.core.kv_tiers import TierOp
from asyncpaged.core.request import Request, RequestStatus
from asyncpaged.core.request import Sequence as Seq
from asyncpaged.core.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    SchedulerStatistics,
    SeqUpdate,
)
from asyncpaged.core.txn import PoolSnapshot, StepTxn, TxnResult
from asyncpaged.errors import RequestFailedError
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
from asyncpaged.model.draft import DraftProposals
from asyncpaged.model.prompt_logprobs import PromptLogprobRows
from asyncpaged.model.runner import SampledToken, SequenceStep, StepPlan
from asyncpaged.model.sampler import SamplingOptions, derive_generator_key
from asyncpaged.outputs import Logprob
from asyncpaged.sampling_params import SamplingParams
from asyncpaged.streams import RequestState
from asyncpaged.structured_outputs import GrammarBackend

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
        self._bad_words: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}
        self.snapshot = snapshot
        self.states: dict[str, RequestState] = {}
        self._inbox = inbox
        self._txns = txns
        self._results = results
        self._executor = executor
        self._swaps = swaps
        self._eos = eos_token_ids
        self._in_flight: SchedulerOutput | None = None
        self._planning = False  # a transaction is at the allocator
        self._idle = anyio.Event()
        self._log = log.bind(actor="scheduler")
        self.num_steps = 0
        self.step_time_s = 0.0
        self.compute_time_s = 0.0
        self.num_jump_forward_tokens = 0  # tokens a grammar forced, appended without sampling
        # engine.pin_prefix waiters (WatchPin): pin id -> (event, what the pool pinned)
        self._pins: dict[int, tuple[anyio.Event, list[PinnedPrefix | None]]] = {}
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
        for pin_id, pinned in result.pinned:
            self._log.info("prefix_pinned", pin_id=pin_id, num_blocks=len(pinned.block_ids)
                           if pinned else 0)  # fmt: skip
            waiter = self._pins.pop(pin_id, None)
            if waiter is None:  # its pin_prefix call ended (ForgetPin): nobody holds the pin
                if pinned is not None:
                    self.scheduler.unpin(pinned.pin_id)
                continue
            event, slot = waiter
            slot.append(pinned)
            event.set()
        out = self.scheduler.apply(txn, result)
        for plan in (*out.swap_outs, *out.swap_ins):
            self._swaps.send_nowait(SwapBlocks(plan=plan))
        for rid in out.preempted:
            self._log.info("request_preempted", request_id=rid)
        if not out.seqs:  # it changed something the next plan may use, or nothing
            return bool(txn.frees or txn.complete_swaps or out.preempted)
        now = time.monotonic()
        steps = []
        bitmasks = self._grammar_bitmasks(out)
        for s in out.seqs:
            state = self.states[s.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
            request = self.scheduler.requests[s.request_id]
            state.num_cached_tokens = request.num_cached_tokens
            draft_k = self._draft_k(request, s) if request.num_speculative_tokens else 0
            if state.plain and state.grammar is None and s.num_samples == 1:
                steps.append(SequenceStep(s.seq_id, s.token_ids, s.start_pos, s.slot_mapping,
                                          s.block_table, s.samples, min_rope_len=s.min_rope_len,
                                          num_draft=s.num_draft, draft_k=draft_k))  # fmt: skip
                continue
            seq = _seq_of(request, s.seq_id)

            def options(
                index: int,
                request: Request = request,
                seq: Seq = seq,
                state: RequestState = state,
            ) -> SamplingOptions | None:
                if request.beam is not None:  # each beam offers its 2k best continuations
                    return SamplingOptions(temperature=0.0, num_logprobs=2 * request.beam.width)
                params = state.params
                return _sampling_options(
                    params, seq.token_ids, seq.num_prompt_tokens, index, self._eos,
                    self._bad_words_ids(params.bad_words), bitmasks.get((seq.seq_id, index)),
                )  # fmt: skip

            row_offset, targets = state.prompt_logprob_targets(s.start_pos, len(s.token_ids))
            verify_options = (
                self._verify_options(state, seq, s.token_ids[len(s.token_ids) - s.num_draft :])
                if s.num_draft
                else ()
            )
            steps.append(
                SequenceStep(
                    seq_id=s.seq_id,
                    token_ids=s.token_ids,
                    num_computed_tokens=s.start_pos,
                    slot_mapping=s.slot_mapping,
                    block_table=s.block_table,
                    do_sample=s.samples,
                    sampling=options(seq.index) if s.samples else None,
                    fanout=tuple(options(i) for i in range(s.num_samples))
                    if s.num_samples > 1
                    else (),
                    want_logprob=state.ranks_by_logprob,
                    min_rope_len=s.min_rope_len,
                    prompt_targets=targets,
                    prompt_row_offset=row_offset,
                    num_prompt_logprobs=state.params.prompt_logprobs or 0,
                    num_draft=s.num_draft,
                    verify_options=verify_options,
                    draft_k=draft_k,
                )
            )
        self._in_flight = out
        await self._executor.send(
            ExecuteStep(output=out, plan=StepPlan(seqs=tuple(steps), copy_pairs=out.copy_on_write))
        )
        return True

    def _draft_k(self, request: Request, s: ScheduledSeq) -> int:
        """Draft-model proposals wanted after this step's token: the request's
        ``num_speculative_tokens``, fewer near ``max_tokens`` or ``max_model_len`` (the next
        step plans at most that many, see the core's ``_drafts``)."""
        if self._draft_proposals is None or not s.samples or s.num_samples != 1:
            return 0
        seq = _seq_of(request, s.seq_id)
        # No draft decodes for a next step that will not propose: a sequence backing off (a
        # skipped step leaves its back-off as it is) or a batch over the speculation limit.
        limit = self.scheduler.config.spec_disable_by_batch_size
        if seq.spec_skip or (limit is not None and len(self.scheduler.running) > limit):
            return 0
        stop = request.stop
        room = stop.max_tokens - seq.num_generated - 2
        if stop.max_model_len is not None:
            room = min(room, stop.max_model_len - len(seq.token_ids) - 2)
        return max(0, min(request.num_speculative_tokens, room))

    def _verify_options(
        self, state: RequestState, seq: Seq, draft: tuple[int, ...]
    ) -> tuple[SamplingOptions | None, ...]:
        """The sampling options of a speculative sequence's verification rows: row ``j`` as
        a plain step would build them after the first ``j`` proposals (penalty history,
        min-tokens mask, bad words, the seed's stream position); () when all are plain."""
        params = state.params
        bad_words = self._bad_words_ids(params.bad_words)
        context = list(seq.token_ids)
        options = []
        for j in range(len(draft) + 1):
            options.append(_sampling_options(params, context, seq.num_prompt_tokens, seq.index,
                                             self._eos, bad_words))  # fmt: skip
            if j < len(draft):
                context.append(draft[j])
        return () if all(o is None for o in options) else tuple(options)

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
                self._record_prompt_logprobs(out, result.prompt_logprobs)
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
        self._fail_requests_of(out, [t for t in sampled if t.error is not None])
        by_row = {(t.seq_id, t.sample_index): t for t in sampled}
        tokens: dict[int, list[int]] = {}
        for (seq_id, _), t in sorted(by_row.items()):
            if t.accepted:  # speculative: the kept proposals, then the target's token
                tokens[seq_id] = [*t.accepted, t.token_id]
            else:
                tokens.setdefault(seq_id, []).append(t.token_id)
        top = {t.seq_id: t.top_logprobs for t in by_row.values() if t.sample_index == 0}
        updates = self.scheduler.update(out, tokens, top)
        if self._draft_proposals is not None:
            self._draft_proposals.record(out.seqs, sampled)
        for update in updates:
            state = self.states[update.request_id]
            upd = update
            if state.matchers:
                if not self._accept_grammar_tokens(state, upd.completion, upd.new_token_ids):
                    self._log.warning("grammar_rejected_token", request_id=upd.request_id,
                                      tokens=list(upd.new_token_ids))  # fmt: skip
                upd = self._jump_forward(state, upd)  # + the tokens the grammar forces
            if state.params.stop:
                state.hold()
                self._record(state, upd, by_row[upd.row])
                self._to_release.append(state)
            else:
                self._to_record.append((state, upd, by_row[upd.row]))
        self._beams_done.extend(self.scheduler.finished_beams)
        self.scheduler.finished_beams.clear()

    def _deliver(self) -> None:
        """Record the last step's outputs (detokenize, logprobs) and wake their readers."""
        to_record, self._to_record = self._to_record, []
        for state, upd, token in to_record:
            self._record(state, upd, token)
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

    def _record(self, state: RequestState, upd: SeqUpdate, token: SampledToken) -> None:
        """One completion's new tokens into its state; a stop string found in their text ends
        the sequence in the scheduler."""
        if state.completions[upd.completion].finish_reason is not None:
            return  # aborted since its tokens were sampled
        params = state.params
        logprobs = None
        if token.logprob is not None:
            logprobs = _logprobs(token, params.logprobs, self._tokenizer if params.detokenize
                                 else None)  # fmt: skip
        matched = state.add_tokens(
            upd.completion, upd.new_token_ids, upd.finish_reason, upd.stop_reason, logprobs
        )
        if matched is not None:
            self.scheduler.finish_seq(upd.request_id, upd.seq_id, "stop", matched)
        if upd.finish_reason is not None or matched is not None:
            self._log_if_finished(upd.request_id, state)

    def _record_prompt_logprobs(
        self, out: SchedulerOutput, rows: tuple[PromptLogprobRows, ...]
    ) -> None:
        """The step's prompt logprobs, recorded before its tokens (the first output has them
        all); a request whose prompt logprobs are complete reads the prefix cache again."""
        if not rows:
            return
        owner = {s.seq_id: s.request_id for s in out.seqs}
        for chunk in rows:
            rid = owner[chunk.seq_id]
            state = self.states.get(rid)
            if state is None:
                continue  # aborted or failed meanwhile
            tokenizer = self._tokenizer if state.params.detokenize else None
            request = self.scheduler.requests.get(rid)
            if state.add_prompt_logprobs(chunk, tokenizer) and request is not None:
                request.read_prefix_cache = True

    def _fail_requests_of(self, out: SchedulerOutput, failed: list[SampledToken]) -> None:
        """Rows whose logits processor raised: each such request fails alone (its waiter gets
        RequestFailedError, its blocks are freed by the next transaction)."""
        if not failed:
            return
        owner = {s.seq_id: s.request_id for s in out.seqs}
        for token in failed:
            rid = owner[token.seq_id]
            if self.scheduler.abort(rid) is None:
                continue  # another row of it failed first
            state = self.states.pop(rid)
            error = RequestFailedError(f"request {rid!r}: its logits processor raised")
            error.__cause__ = token.error
            state.fail_alone(error)
            self._log.info("request_failed", request_id=rid, error=repr(token.error))

    def _grammar_bitmasks(self, out: SchedulerOutput) -> dict[tuple[int, int], torch.Tensor]:
        """Structured outputs: (seq id, completion index) -> the next-token bitmask of that
        completion's matcher (made on its first step; it has accepted every token the
        completion holds), for every sampling row of the step, filled in one buffer."""
        keys: list[tuple[int, int]] = []
        matchers: list[Any] = []
        for s in out.seqs:
            state = self.states[s.request_id]
            if not s.samples or state.grammar is None:
                continue
            assert self._grammars is not None, "a compiled grammar without a grammar backend"
            request = self.scheduler.requests[s.request_id]
            seq = next(q for q in request.seqs if q.seq_id == s.seq_id)
            for index in range(s.num_samples) if s.num_samples > 1 else (seq.index,):
                matcher = state.matchers.get(index)
                if matcher is None:
                    matcher = state.matchers[index] = self._grammars.matcher(state.grammar)
                keys.append((s.seq_id, index))
                matchers.append(matcher)
        if not matchers:
            return {}
        assert self._grammars is not None
        rows = self._grammars.next_token_bitmasks(matchers)  # [R, W]
        return dict(zip(keys, rows.unbind(0), strict=True))

    def _jump_forward(self, state: RequestState, upd: SeqUpdate) -> SeqUpdate:
        """Structured outputs' jump-forward: after a sampled token, append the tokens the
        grammar forces next (``EngineConfig.structured_outputs_jump_forward``); the next step
        computes them as a chunk. Not for requests that report logprobs (a forced token's
        logprob is never computed) or rank by them (best_of)."""
        grammars = self._grammars
        matcher = state.matchers.get(upd.completion)
        if (
            matcher is None or grammars is None or not grammars.jump_forward
            or upd.finish_reason is not None or state.params.logprobs is not None
            or state.ranks_by_logprob
        ):  # fmt: skip
            return upd
        forced = grammars.jump_forward_tokens(matcher)
        if not forced:
            return upd
        appended, reason, stop = self.scheduler.append_forced(upd.request_id, upd.seq_id, forced)
        self.num_jump_forward_tokens += len(appended)
        return upd._replace(new_token_ids=upd.new_token_ids + appended,
                                   finish_reason=reason, stop_reason=stop)  # fmt: skip

    def _accept_grammar_tokens(
        self, state: RequestState, index: int, tokens: Sequence[int]
    ) -> bool:
        """Feed a completion's new tokens to its matcher; False if the grammar refused one
        (the bitmask allowed it, so only a stop token past the end can)."""
        matcher = state.matchers.get(index)
        if matcher is None:
            return True
        return all(matcher.accept_token(t) or matcher.is_terminated() for t in tokens)

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Token ids of a request's bad words, tokenized once per distinct word list."""
        if not words:
            return ()
        ids = self._bad_words.get(words)
        if ids is None:
            if len(self._bad_words) >= 1024:
                self._bad_words.clear()
            ids = self._bad_words[words] = bad_words_token_ids(self._tokenizer, words)
        return ids

    def _log_if_finished(self, request_id: str, state: RequestState) -> None:
        if state.finished and request_id in self.states:
            del self.states[request_id]
            self._log.info(
                "request_finished",
                request_id=request_id,
                finish_reasons=[c.finish_reason for c in state.completions],
                num_tokens=sum(len(c.token_ids) for c in state.completions),
            )


def _seq_of(request: Request, seq_id: int) -> Seq:
    if len(request.seqs) == 1:
        return request.seqs[0]
    return next(q for q in request.seqs if q.seq_id == seq_id)


def _sampling_options(
    params: SamplingParams,
    token_ids: list[int],
    num_prompt: int,
    index: int,
    eos_token_ids: frozenset[int],
    bad_words_ids: tuple[tuple[int, ...], ...] = (),
    token_bitmask: torch.Tensor | None = None,
) -> SamplingOptions | None:
    """The executor's per-row sampling options; None for plain greedy (the fast path)."""
    if token_bitmask is None and params.is_plain_greedy:
        return None
    num_generated = len(token_ids) - num_prompt
    # The output is sliced only for bad words: a per-step copy of every history otherwise.
    banned = banned_next_tokens(bad_words_ids, token_ids[num_prompt:]) if bad_words_ids else ()
    controlled = bool(
        params.logit_bias
        or params.allowed_token_ids is not None
        or banned
        or token_bitmask is not None
        or params.logits_processors
    )
    mask: tuple[int, ...] = ()
    if num_generated < params.min_tokens:
        mask = tuple(params.stop_token_ids)
        if not params.ignore_eos:
            mask = (*mask, *sorted(eos_token_ids - set(mask)))
    penalized = (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )
    if (
        params.is_greedy
        and not penalized
        and not mask
        and not controlled
        and params.logprobs is None
    ):
        return None
    return SamplingOptions(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        num_logprobs=params.logprobs,
        min_tokens_mask_ids=mask,
        prompt_token_ids=tuple(token_ids[:num_prompt]) if penalized else (),
        output_token_ids=(
            tuple(token_ids[num_prompt:]) if penalized or params.logits_processors else ()
        ),
        generator_key=derive_generator_key(params.seed, index, num_generated)
        if params.seed is not None
        else 0,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
        banned_token_ids=banned,
        token_bitmask=token_bitmask,
        logits_processors=params.logits_processors,
    )


def bad_words_token_ids(tokenizer: Any, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids, as vLLM tokenizes them: the word (left-stripped), and the word
    after a space where that tokenizes into as many tokens, starting with another one."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(ids for ids in out if ids)


def banned_next_tokens(
    bad_words_ids: tuple[tuple[int, ...], ...], output: list[int]
) -> tuple[int, ...]:
    """The last token of every bad word whose other tokens end the output (vLLM's rule: a
    one-token word is always banned)."""
    banned = []
    for ids in bad_words_ids:
        prefix = ids[:-1]
        if len(prefix) <= len(output) and (not prefix or tuple(output[-len(prefix) :]) == prefix):
            banned.append(ids[-1])
    return tuple(dict.fromkeys(banned))


def _logprobs(token: SampledToken, num_top: int | None, tokenizer: Any) -> dict[int, Logprob]:
    """The sampled token's logprob and the top ``num_top`` (vLLM's per-position dict), each
    with its text (``tokenizer.decode([id])``, as vLLM fills ``decoded_token``) when a
    tokenizer is given."""

    def text(token_id: int) -> str | None:
        return None if tokenizer is None else str(tokenizer.decode([token_id]))

    top = enumerate(token.top_logprobs[: num_top or 0], 1)
    out = {tid: Logprob(logprob=lp, rank=rank, decoded_token=text(tid)) for rank, (tid, lp) in top}
    assert token.logprob is not None
    out[token.token_id] = Logprob(
        logprob=token.logprob, rank=token.rank, decoded_token=text(token.token_id)
    )
    return out
