"""Per-request output state, its single-slot sink, and the :class:`RequestStream` users hold
(the sink wakes the one reader with :class:`Wakeup`).

The engine writes into a request's :class:`RequestState` and wakes its sink; it never waits for
the reader. The reader builds what it sees when it looks: the whole output so far (CUMULATIVE),
everything new since its last look (DELTA, so a slow reader gets merged deltas), or only the end
(FINAL_ONLY). One writer and one reader on one event loop: no locks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from asyncpaged.detokenizer import IncrementalDetokenizer
from asyncpaged.errors import EngineDeadError
from asyncpaged.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from asyncpaged.reply_parser import ReplyParser, ReplyParsing
from asyncpaged.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from asyncpaged.worker.protocol import PromptLogprobRows


class Wakeup:
    """Wakes the one reader of a request: ``wait`` returns at the first ``set`` after it began
    (the reader re-checks its state around it, so a ``set`` with no reader waiting is moot).

    On asyncio the reader awaits a bare future, the cheapest wake-up the loop has (a state is
    woken once per step); on any other loop an ``anyio.Event``. Writer and reader share one
    event loop."""

    __slots__ = ("_event", "_future", "_loop")

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None
        self._event: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | bool | None = None  # False: not asyncio

    def set(self) -> None:
        future, event = self._future, self._event
        if future is not None:
            self._future = None
            if not future.done():
                future.set_result(None)
        if event is not None:
            self._event = None
            event.set()

    def wait(self) -> Awaitable[None]:
        """What to await: the future itself (no coroutine frame of its own to make and resume
        once a step per reader), or the event's wait."""
        loop = self._loop
        if loop is None:
            try:
                loop = self._loop = asyncio.get_running_loop()
            except RuntimeError:  # trio, or another loop anyio runs on
                loop = self._loop = False
        if loop:
            assert isinstance(loop, asyncio.AbstractEventLoop)
            future = self._future = loop.create_future()
            return future
        event = self._event = anyio.Event()
        return event.wait()


@dataclass(slots=True, eq=False)
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    read_tokens: int = 0  # DELTA cursors
    read_text: int = 0
    reply: ReplyParser | None = None  # a chat reply split into thinking, calls and content


def is_plain(params: SamplingParams, *, beam: bool) -> bool:
    """Plain greedy, one completion, nothing asked beyond tokens and text: each step's sampling
    options are None (the runner's fast path) unless a grammar is set."""
    return (
        params.is_plain_greedy and params.num_sequences == 1 and not beam
        and params.prompt_logprobs is None
    )  # fmt: skip


def ranks_by_logprob(params: SamplingParams) -> bool:
    """best_of > n ranks the candidates by cumulative logprob and shows the n best at the end."""
    return params.num_sequences > params.n


_serials = itertools.count()


class RequestState:
    """Everything the engine knows of one request's outputs. Its writer: the intake until it
    hands the request on (prompt, rejection, an abort there), then the output processor
    (``actors/output_processor.py``); its reader: the request's stream, on the same loop."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        arrival_time: float,
        *,
        beam: bool = False,
        reply_parsing: ReplyParsing | None = None,
    ) -> None:
        self.request_id = request_id
        self.serial = next(_serials)  # this submission, whatever later reuses its id
        self.prompt = prompt
        self.prompt_token_ids: list[int] = []
        self.params = params
        self.completions = [
            _Completion(index=i, detokenizer=None) for i in range(params.num_sequences)
        ]
        self.ranks_by_logprob = ranks_by_logprob(params)
        self._stop_strings = bool(params.stop)  # only then can the text end a completion
        self.beam = beam  # completions are filled in at the end (finish_beams)
        self.reply_parsing = reply_parsing
        for c in self.completions:
            if params.logprobs is not None:
                c.logprobs = []
            if params.logprobs is not None or self.ranks_by_logprob:
                c.cumulative_logprob = 0.0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        # The prompt opened a thinking block (the engine's reasoning parser's
        # prompt_opens_reasoning), set before the first output; False without a parser
        self.in_reasoning_at_start = False
        # prompt_logprobs: [None, position 1, ...], filled in position order by the steps
        self.prompt_logprobs: PromptLogprobs | None = None
        self._prompt_logprobs_read = False  # DELTA: sent once
        self.error: BaseException | None = None
        self.rejection: BaseException | None = None
        # Set by the engine's abort (and a dropped stream) wherever the request is: the intake
        # then finishes it with "abort" instead of handing it to the scheduler.
        self.abort_requested = False
        self._event = Wakeup()
        # The reader waits for the end only: new tokens alone do not wake it.
        self._reader_wants_end = False
        self._held = False  # recorded outputs hidden from the reader until release()

    def start(self, prompt_token_ids: list[int], tokenizer: Any) -> None:
        """The request reached the scheduler: set up detokenizing (no tokenizer: ids only) and
        a chat reply's parsing (``in_reasoning_at_start`` is set by then)."""
        self.prompt_token_ids = prompt_token_ids
        self.metrics.num_prompt_tokens = len(prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if tokenizer is not None and self.params.detokenize:
            parsing = self.reply_parsing
            for c in self.completions:
                c.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, self.params)
                if parsing is not None:
                    streamed = self.params.output_kind is not RequestOutputKind.FINAL_ONLY
                    c.reply = parsing.start(in_reasoning=self.in_reasoning_at_start,
                                            streamed=streamed)  # fmt: skip

    @property
    def is_done(self) -> bool:
        """Finished, refused, or failed: its request id is free again."""
        return self.finished or self.rejection is not None or self.error is not None

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return False
        completions = self.completions
        if len(completions) == 1:
            return completions[0].finish_reason is not None
        return all(c.finish_reason is not None for c in completions)

    def add_tokens(
        self,
        index: int,
        token_ids: tuple[int, ...],
        finish_reason: str | None,
        stop_reason: int | str | None,
        logprobs: dict[int, Logprob] | None = None,
        now: float | None = None,
    ) -> str | None:
        """Record new tokens (``now``: the time they count as produced at, by default the
        present); returns the stop string if the text matched one (the caller then ends the
        sequence in the scheduler)."""
        c = self.completions[index]
        if now is None:
            now = time.monotonic()
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_generation_tokens += len(token_ids)
        c.token_ids.extend(token_ids)
        if logprobs is not None:
            if c.logprobs is not None:
                c.logprobs.append(logprobs)
            if c.cumulative_logprob is not None:
                c.cumulative_logprob += logprobs[token_ids[-1]].logprob
        matched: str | None = None
        detokenizer = c.detokenizer
        if detokenizer is not None:
            # The scheduler stops with "stop" only on EOS or a stop token id: the last id.
            text = detokenizer.update(token_ids, stop_terminated=finish_reason == "stop")
            if finish_reason is not None:
                if not detokenizer.finished:
                    text += detokenizer.finish()
            elif self._stop_strings and detokenizer.stop_reason is not None:
                matched = detokenizer.stop_reason
                finish_reason, stop_reason = "stop", matched
                consumed = len(detokenizer.output_token_ids)
                del c.token_ids[consumed:]  # ids after the stop string were never produced
            if text:
                c.text += text
            reply = c.reply
            if reply is not None:
                if text:
                    reply.feed(text)
                if finish_reason is not None:
                    reply.finish()
                    if finish_reason == "stop" and reply.num_calls:
                        finish_reason = "tool_calls"
        if finish_reason is not None:
            c.finish_reason, c.stop_reason = finish_reason, stop_reason
            if self.finished:
                metrics.finished_time = now
        if finish_reason is not None or not self._reader_wants_end:
            self._event.set()
        return matched

    def hold(self) -> None:
        """Hide what is recorded next from the reader until :meth:`release` (the scheduler
        actor records a step's text early for stop strings, and shows it once the blocks of
        what finished are free)."""
        self._held = True

    def release(self) -> None:
        self._held = False
        self._event.set()

    def add_prompt_logprobs(self, rows: PromptLogprobRows, tokenizer: Any) -> bool:
        """Record one step's prompt logprobs (vLLM's dicts: the prompt token with its rank, then
        the top k with ranks 1..k; ``decoded_token`` from ``tokenizer``, if given); True once
        every position is known."""
        known = self.prompt_logprobs
        assert known is not None, "prompt logprobs for a request that did not ask for them"
        assert rows.first_position <= len(known), "prompt logprobs must arrive in order"
        texts: dict[int, str | None] = {}

        def text(token_id: int) -> str | None:
            if tokenizer is None:
                return None
            if token_id not in texts:
                texts[token_id] = str(tokenizer.decode([token_id]))
            return texts[token_id]

        skip = len(known) - rows.first_position
        entries = zip(rows.token_ids, rows.logprobs, rows.ranks, rows.top, strict=True)
        for i, (token, logprob, rank, top) in enumerate(entries):
            if i < skip:
                continue
            entry = {token: Logprob(logprob=logprob, rank=rank, decoded_token=text(token))}
            for top_rank, (top_id, top_logprob) in enumerate(top, 1):
                entry[top_id] = Logprob(top_logprob, top_rank, text(top_id))
            known.append(entry)
        return len(known) >= len(self.prompt_token_ids)

    def _prompt_logprobs_out(self, kind: RequestOutputKind) -> PromptLogprobs | None:
        """What an output carries: None until all are known, then all of them (DELTA: in its
        first output only, later ones an empty list, as vLLM's ``pop_prompt_logprobs``)."""
        known = self.prompt_logprobs
        if known is None or len(known) < len(self.prompt_token_ids):
            return None
        if kind is RequestOutputKind.DELTA:
            if self._prompt_logprobs_read:
                return []
            self._prompt_logprobs_read = True
        return list(known)

    def abort(self) -> None:
        for c in self.completions:
            if c.finish_reason is None:
                if c.detokenizer is not None and not c.detokenizer.finished:
                    c.text += c.detokenizer.finish()
                c.finish_reason = "abort"
        self.metrics.finished_time = time.monotonic()
        self._event.set()

    def fail_alone(self, error: BaseException) -> None:
        """This request failed while running (the engine goes on): its waiter gets ``error``."""
        self.rejection = error
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    # ---- the reader's side ----------------------------------------------------------------

    def finish_beams(self, hypotheses: list[tuple[list[int], float, bool]], tokenizer: Any) -> None:
        """A beam search ended: (tokens, cumulative logprob, ended at EOS) per hypothesis, best
        first, become the completions."""
        now = time.monotonic()
        self.metrics.first_token_time = self.metrics.first_token_time or now
        self.metrics.last_token_time = self.metrics.finished_time = now
        skip = self.params.skip_special_tokens
        self.completions = [
            _Completion(
                index=i,
                detokenizer=None,
                token_ids=tokens,
                text=tokenizer.decode(tokens, skip_special_tokens=skip) if tokenizer else "",
                cumulative_logprob=logprob,
                finish_reason="stop" if eos else "length",
            )
            for i, (tokens, logprob, eos) in enumerate(hypotheses)
        ]
        self._event.set()

    def _has_news(self, kind: RequestOutputKind) -> bool:
        if self.error is not None or self.rejection is not None:
            return True
        if self._held:
            return False
        completions = self.completions
        if len(completions) == 1:  # (best_of > n has several; a beam search fills its own in
            # at the end only, so it has no news before)
            c = completions[0]
            if c.finish_reason is not None:
                return True
            if kind is RequestOutputKind.FINAL_ONLY:
                return False
            return c.read_tokens < len(c.token_ids) or _unread_text(c)
        if self.finished:
            return True
        if kind is RequestOutputKind.FINAL_ONLY or self.ranks_by_logprob or self.beam:
            return False
        return any(c.read_tokens < len(c.token_ids) or _unread_text(c)
                   for c in completions)  # fmt: skip

    def news(self, kind: RequestOutputKind) -> Awaitable[None] | None:
        """None when the reader has news for an output of ``kind`` (raising the request's
        refusal or failure, or :class:`EngineDeadError` once the engine failed); else what to
        await before asking again (one wake-up; a plain awaitable, not a coroutine, so a
        reader waits without a frame of this method's own each step)."""
        self._reader_wants_end = (
            kind is RequestOutputKind.FINAL_ONLY or self.ranks_by_logprob or self.beam
        )
        if not self._has_news(kind):
            return self._event.wait()
        if self.rejection is not None:
            raise self.rejection
        if self.error is not None:
            raise EngineDeadError("the engine stopped") from self.error
        return None

    async def wait(self, kind: RequestOutputKind) -> None:
        while (wakeup := self.news(kind)) is not None:
            await wakeup

    def snapshot(self, kind: RequestOutputKind) -> RequestOutput:
        completions = self.completions
        if self.ranks_by_logprob:  # only reached once finished
            ranked = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))
            completions = ranked[: self.params.n]
        delta = kind is RequestOutputKind.DELTA
        outputs = []
        for c in completions:
            token_ids, logprobs = c.token_ids, c.logprobs
            if delta:
                read = c.read_tokens
                tokens, text = token_ids[read:], c.text[c.read_text :]
                if logprobs is not None:
                    logprobs = logprobs[read:]
            else:
                tokens, text = list(token_ids), c.text
                if logprobs is not None:
                    logprobs = list(logprobs)
            c.read_tokens, c.read_text = len(token_ids), len(c.text)
            # (positional, in the fields' order: a reader makes one per step)
            out = CompletionOutput(c.index, text, tokens, c.cumulative_logprob, logprobs,
                                   c.finish_reason, c.stop_reason)  # type: ignore[arg-type]  # fmt: skip
            if c.reply is not None:
                view = c.reply.delta() if delta else c.reply.whole()
                out.text, out.reasoning = view.content, view.reasoning
                out.tool_calls, out.tool_call_deltas = view.tool_calls, view.tool_call_deltas
            outputs.append(out)
        prompt_logprobs = None if self.prompt_logprobs is None else self._prompt_logprobs_out(kind)
        return RequestOutput(
            self.request_id, self.prompt,
            self.prompt_token_ids,  # one list for every output, as vLLM
            outputs, self.finished, self.metrics, self.num_cached_tokens, prompt_logprobs,
        )  # fmt: skip


def _unread_text(c: _Completion) -> bool:
    if c.reply is not None:
        return c.reply.has_news()
    return c.read_text < len(c.text)


class RequestStream:
    """What :meth:`AsyncEngine.generate` returns: ``await`` it for the final output, or
    ``async for`` over it for outputs per the request's ``output_kind``.

    If the task awaiting or iterating is cancelled, or the iterator is closed with
    :meth:`aclose` before the end, the request is aborted (finish reason "abort") and its
    blocks are freed within one scheduler step. So is a stream dropped unfinished (breaking
    out of ``async for`` without ``aclose``, never awaiting it): its finalizer only sets the
    request's ``abort_requested`` and queues it on ``dropped`` (safe from any thread, as the
    cyclic GC may run there); the scheduler takes it from there at its next loop.
    """

    def __init__(
        self,
        state: RequestState,
        abort: Callable[[RequestState], None],
        dropped: Callable[[RequestState], None] | None = None,
    ) -> None:
        self.request_id = state.request_id
        self._state = state
        self._abort = abort
        self._dropped = dropped
        self._kind = state.params.output_kind
        self._done = False

    def __del__(self) -> None:
        state = self._state
        if not self._done and not state.is_done and not state.abort_requested:
            state.abort_requested = True
            if self._dropped is not None:
                self._dropped(state)

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self._final().__await__()

    async def _final(self) -> RequestOutput:
        await self._guarded_wait(RequestOutputKind.FINAL_ONLY)
        self._done = True
        return self._state.snapshot(RequestOutputKind.CUMULATIVE)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        state, kind = self._state, self._kind
        try:  # (not through _guarded_wait: a reader resumes through here once a step)
            while (wakeup := state.news(kind)) is not None:
                await wakeup
        except BaseException as exc:
            self._wait_failed(exc)
            raise
        out = state.snapshot(kind)
        self._done = out.finished
        return out

    async def aclose(self) -> None:
        """Stop reading; aborts the request if it has not finished."""
        if not self._done:
            self._done = True
            self._abort(self._state)

    async def _guarded_wait(self, kind: RequestOutputKind) -> None:
        try:
            await self._state.wait(kind)
        except BaseException as exc:
            self._wait_failed(exc)
            raise

    def _wait_failed(self, exc: BaseException) -> None:
        """The reader's wait raised: cancelled (abort the request unless it ended), or the
        request was refused or failed (nothing is left to abort)."""
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            if not self._state.finished and self._state.rejection is None:
                self._abort(self._state)
        else:
            self._done = True
