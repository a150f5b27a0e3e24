"""The output processor actor: every request's output state, from submission to its end (vLLM
v1's OutputProcessor). It detokenizes, finds stop strings, builds logprob dicts and wakes the
readers; the scheduler actor tells it what each step produced and never sees a state."""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged._log import get_logger
from asyncpaged.actors.idle import IdleSignal
from asyncpaged.actors.messages import (
    EndRequest,
    OutputsInbox,
    PromptReady,
    RecordOutputs,
    StopsFound,
)
from asyncpaged.outputs import Logprob
from asyncpaged.sampled_token import SampledToken
from asyncpaged.sched.scheduler import EngineCoreOutput
from asyncpaged.streams import RequestState

__all__ = ["OutputProcessor"]

log = get_logger(__name__)


class OutputProcessor:
    """Owns every live :class:`RequestState` (the registry of requests submitted and not done),
    their detokenizers, stop strings and logprob dicts, and the event loop's tokenizer.

    The engine registers a state when a request is submitted (a call on the loop, as vLLM's
    AsyncLLM adds a request to its OutputProcessor) and reads the registry through
    :attr:`live` (ids in use, aborts); from then on only this actor writes the state. The
    intake reports the prompt (``PromptReady``) or the request's end there (``EndRequest``);
    the scheduler actor sends each step's outputs (``RecordOutputs``) and the requests it ended
    (``EndRequest``), and for requests with stop strings waits for this actor's
    :class:`StopsFound` before it plans again.

    Invariants: a state leaves the registry exactly when it is done (finished, refused, failed
    alone) or the engine fails; every state held by a stop check is released by the next
    ``RecordOutputs`` that is not one, and the scheduler sends one after every stop check.
    """

    def __init__(
        self,
        inbox: MemoryObjectReceiveStream[OutputsInbox],
        stop_replies: MemoryObjectSendStream[StopsFound],
        tokenizer: Any,
    ) -> None:
        self._inbox = inbox
        self._replies = stop_replies
        self._tokenizer = tokenizer
        self._live: dict[str, RequestState] = {}
        self.live: Mapping[str, RequestState] = MappingProxyType(self._live)
        self._held: list[RequestState] = []  # recorded by a stop check, not yet shown
        self._idle = IdleSignal(lambda: self.is_idle)
        self._log = log.bind(actor="outputs")

    # ---- the engine's calls (on the loop) -----------------------------------------------------

    def register(self, state: RequestState) -> None:
        """A request was submitted: its state is live (its id in use) until done."""
        self._live[state.request_id] = state

    def forget(self, state: RequestState) -> None:
        """A registered request could not be queued after all (the engine is stopping)."""
        if self._live.get(state.request_id) is state:
            del self._live[state.request_id]

    def fail_all(self, error: BaseException) -> None:
        """The engine failed: every live request's waiter gets ``error`` (they stay here, so a
        later failure cause reaches none twice)."""
        for state in self._live.values():
            state.fail(error)

    @property
    def is_idle(self) -> bool:
        return not self._held and self._inbox.statistics().current_buffer_used == 0

    async def wait_idle(self) -> None:
        """Wait until every message sent here is handled and nothing is held (any number of
        waiters: ``IdleSignal``)."""
        await self._idle.wait()

    # ---- the loop -----------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox, self._replies:
            async for msg in self._inbox:
                self._handle(msg)
                self._idle.notify()

    def _handle(self, msg: OutputsInbox) -> None:
        match msg:
            case PromptReady(request_id=rid, prompt=prompt, prompt_token_ids=ids):
                state = self._live[rid]
                if prompt is not None:
                    state.prompt = prompt
                state.in_reasoning_at_start = msg.in_reasoning_at_start
                state.start(list(ids), self._tokenizer)
            case RecordOutputs():
                self._record(msg)
            case EndRequest(request_id=rid, error=error):
                ended = self._live.pop(rid, None)
                if ended is None:
                    return
                if error is None:
                    ended.abort()
                else:
                    ended.fail_alone(error)

    def _record(self, msg: RecordOutputs) -> None:
        live, tokenizer = self._live, self._tokenizer
        for rid, rows in msg.prompt_logprobs:  # before the tokens: the first output has them
            state = live.get(rid)
            if state is not None:
                state.add_prompt_logprobs(rows, tokenizer if state.params.detokenize else None)
        for s in msg.scheduled:
            state = live.get(s.request_id)
            if state is not None:
                if state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = s.first_scheduled_time
                state.num_cached_tokens = s.num_cached_tokens
        matches: list[tuple[str, int, str]] = []
        check_stops, now = msg.check_stops, time.monotonic()  # (one time for the step's tokens)
        for upd in msg.tokens:
            state = live.get(upd.request_id)
            if state is None:
                continue  # aborted or failed since its tokens were sampled
            if check_stops:
                state.hold()
                self._held.append(state)
            matched = record_tokens(state, upd, tokenizer, now)
            if matched is not None:
                matches.append((upd.request_id, upd.seq_id, matched))
            # (only an end of this completion, or a stop string in its text, ends the request)
            if (upd.finish_reason is not None or matched is not None) and state.finished:
                self._finished(upd.request_id, state)
        for rid, hypotheses in msg.beams:
            state = live[rid]
            state.finish_beams([(list(t), lp, eos) for t, lp, eos in hypotheses], tokenizer)
            self._finished(rid, state)
        if msg.check_stops:
            self._replies.send_nowait(StopsFound(matches=tuple(matches)))
            return
        assert not matches, "a stop string matched outside a stop check"
        held, self._held = self._held, []
        for state in held:
            state.release()

    def _finished(self, request_id: str, state: RequestState) -> None:
        if self._live.get(request_id) is state:
            del self._live[request_id]
            self._log.info(
                "request_finished",
                request_id=request_id,
                finish_reasons=[c.finish_reason for c in state.completions],
                num_tokens=sum(len(c.token_ids) for c in state.completions),
            )


def record_tokens(
    state: RequestState, upd: EngineCoreOutput, tokenizer: Any, now: float
) -> str | None:
    """One completion's new tokens into its state (with the logprobs of the row that drew
    them, if asked), produced at ``now``; returns the stop string its text matched (the
    scheduler then ends the sequence), if any."""
    if state.completions[upd.completion].finish_reason is not None:
        return None  # aborted since its tokens were sampled
    logprobs = None
    token = upd.sampled
    if token.logprob is not None:
        params = state.params
        logprobs = _logprobs(token, params.logprobs, tokenizer if params.detokenize else None)
    return state.add_tokens(
        upd.completion, upd.new_token_ids, upd.finish_reason, upd.stop_reason, logprobs, now
    )


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
