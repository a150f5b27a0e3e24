"""The intake actor: tokenizes text prompts off the event loop and hands requests on."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged._log import get_logger
from asyncpaged.actors.messages import (
    AddRequest,
    ChatPrompt,
    EndRequest,
    OutputsInbox,
    PromptReady,
    RequestInfo,
    SchedulerInbox,
    SubmitRequest,
)
from asyncpaged.actors.worker_thread import WorkerThread
from asyncpaged.errors import InvalidRequestError
from asyncpaged.inputs import truncate_prompt
from asyncpaged.model.loader import load_tokenizer
from asyncpaged.reasoning import ReasoningParser
from asyncpaged.sched.beam_search import BeamSearcher
from asyncpaged.sched.request import Request, StopCriteria
from asyncpaged.sched.request import Sequence as Seq
from asyncpaged.streams import is_plain, ranks_by_logprob
from asyncpaged.structured_outputs import GrammarBackend

log = get_logger(__name__)


class IntakeActor:
    """Turns :class:`SubmitRequest` into the scheduler's :class:`AddRequest` (and the output
    processor's :class:`PromptReady`, sent first).

    Per request: a prompt of token ids (validated by ``generate``) without a grammar is handed on
    at once, in arrival order; one that needs work (a chat to render, a text to tokenize, a
    grammar to compile) gets its own task, whose work runs in a worker thread (one at a time:
    fast tokenizers are not re-entrant), so a long prompt never holds up a prompt of ids. A
    prompt that turns out invalid (too long, a template or tokenizer that fails on it, a grammar
    that does not compile) is rejected to its waiter alone (an ``EndRequest`` with the error,
    to the output processor) and never reaches the scheduler; so is whatever the tokenizer or
    grammar compiler raises. A request aborted while here (its ``abort_requested`` set) is
    finished with "abort" (an ``EndRequest`` without error) instead of being handed on. It
    writes no request state.

    With a reasoning parser (``reasoning``), it tells each request whether its prompt opened a
    thinking block (``prompt_opens_reasoning`` of the rendered chat or text prompt; for a
    prompt of ids, of its last tokens decoded: :func:`ids_open_reasoning`).

    Invariant: every message taken from the inbox ends in exactly one of: an ``AddRequest`` sent,
    a rejection, an abort; ``on_released`` is called for the latter two (the scheduler counts
    requests still in intake as not idle).
    """

    def __init__(
        self,
        tokenizer: Any,
        validate_ids: Callable[[Sequence[int], Any], int],
        stop_criteria: Callable[[Any, int], StopCriteria],
        inbox: MemoryObjectReceiveStream[SubmitRequest],
        outbox: MemoryObjectSendStream[SchedulerInbox],
        outputs: MemoryObjectSendStream[OutputsInbox],
        seq_ids: Iterator[int],
        grammars: GrammarBackend | None = None,
        on_released: Callable[[], None] | None = None,
        num_speculative_tokens: int = 0,
        reasoning: type[ReasoningParser] | None = None,
        loop_tokenizer: Any = None,
    ) -> None:
        """``loop_tokenizer``: the event loop's tokenizer (the intake's own belongs to its
        worker thread), to decode the end of a prompt of ids handed on from the loop."""
        self.tokenizer = tokenizer
        self._reasoning = reasoning
        self._loop_tokenizer = loop_tokenizer
        self._num_speculative = num_speculative_tokens
        self._grammars = grammars
        self._validate_ids = validate_ids
        self._stop_criteria = stop_criteria
        self._inbox = inbox
        self._outbox = outbox
        self._outputs = outputs
        self._on_released = on_released
        # The one thread its tokenizer runs on (the engine's pin_prefix shares it).
        self.thread = WorkerThread("asyncpaged-intake")
        self._arrivals = itertools.count()
        self._seq_ids = seq_ids
        self._log = log.bind(actor="intake")
        self.num_pending = 0  # taken from the inbox, not yet handed on, rejected or aborted
        self.num_aborted = 0  # aborted before they reached the scheduler

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with self._inbox, self._outbox, self._outputs, anyio.create_task_group() as tg:
                async for msg in self._inbox:
                    self.num_pending += 1
                    if msg.prompt_token_ids is not None and msg.params.structured_outputs is None:
                        self._admit_ids(msg)
                    else:
                        tg.start_soon(self._admit, msg)
        finally:
            self.thread.close()

    def _admit_ids(self, msg: SubmitRequest) -> None:
        assert msg.prompt_token_ids is not None
        try:
            ids = truncate_prompt(msg.prompt_token_ids, msg.params)
            max_tokens = self._validate_ids(ids, msg.params)
        except InvalidRequestError as exc:
            self._release(msg, exc)
            return
        opens = self._reasoning is not None and ids_open_reasoning(
            self._reasoning, ids, self._loop_tokenizer
        )
        self._hand_on(msg, ids, max_tokens, None, None, opens)

    async def _admit(self, msg: SubmitRequest) -> None:
        """Render, tokenize and validate (worker thread), compile the grammar, hand it on."""
        try:
            text, ids, max_tokens, opens = await self.thread.run(self._prepare, msg)
            grammar = await self._compile_grammar(msg, text, opens)
        except InvalidRequestError as exc:
            self._release(msg, exc)
            return
        self._hand_on(msg, ids, max_tokens, text, grammar, opens)

    def _prepare(self, msg: SubmitRequest) -> tuple[str | None, tuple[int, ...], int, bool]:
        """(a chat's rendered text, prompt ids, max new tokens, whether the prompt opened a
        thinking block), in the worker thread: nothing here is O(prompt) on the event loop.
        What the tokenizer or template raises fails this request alone."""
        text = None
        if msg.prompt_token_ids is not None:
            ids: Sequence[int] = msg.prompt_token_ids
        elif msg.chat is not None:
            text, ids = render_chat(self.tokenizer, msg.chat)
        else:
            assert msg.prompt is not None
            ids = tokenize(self.tokenizer, msg.prompt)
        truncated = truncate_prompt(ids, msg.params)
        max_tokens = self._validate_ids(truncated, msg.params)
        reasoning, opens = self._reasoning, False
        if reasoning is not None:
            # (a truncated prompt keeps its end, where the thinking opens)
            source = text if text is not None else msg.prompt
            opens = (
                reasoning.prompt_opens_reasoning(source)
                if source is not None
                else ids_open_reasoning(reasoning, truncated, self.tokenizer)
            )
        return text, truncated, max_tokens, opens

    def _hand_on(
        self, msg: SubmitRequest, ids: tuple[int, ...], max_tokens: int, text: str | None,
        grammar: Any, in_reasoning: bool,
    ) -> None:  # fmt: skip
        """Send the request on, unless it was aborted meanwhile (synchronous: an abort either
        comes before, and is seen here, or after, and reaches the scheduler)."""
        state = msg.state
        if state.abort_requested:
            self.num_aborted += 1
            self._outputs.send_nowait(EndRequest(request_id=state.request_id))
            self._release(msg, None)
            return
        request = self._request(msg, ids, max_tokens)
        info = RequestInfo(
            params=msg.params, serial=state.serial, plain=is_plain(msg.params, beam=state.beam),
            ranks_by_logprob=ranks_by_logprob(msg.params), prompt_token_ids=ids, grammar=grammar,
            in_reasoning_at_start=in_reasoning, lora_path=msg.lora_path,
        )  # fmt: skip
        self.num_pending -= 1
        self._outputs.send_nowait(PromptReady(request_id=state.request_id, prompt=text,
                                              prompt_token_ids=ids,
                                              in_reasoning_at_start=in_reasoning))  # fmt: skip
        self._outbox.send_nowait(AddRequest(request=request, info=info))

    def _release(self, msg: SubmitRequest, error: InvalidRequestError | None) -> None:
        if error is not None:
            self._outputs.send_nowait(EndRequest(request_id=msg.state.request_id, error=error))
        self.num_pending -= 1
        if self._on_released is not None:
            self._on_released()

    def _request(self, msg: SubmitRequest, ids: tuple[int, ...], max_tokens: int) -> Request:
        num_seqs = msg.params.num_sequences if msg.beam is None else 1
        request = Request(
            request_id=msg.state.request_id,
            arrival=next(self._arrivals),
            seqs=[Seq(seq_id=next(self._seq_ids), index=0, token_ids=list(ids),
                      num_prompt_tokens=len(ids))],
            stop=self._stop_criteria(msg.params, max_tokens),
            cache_salt=msg.cache_salt,
            lora_key=msg.lora_key,
            priority=msg.priority,
            num_samples=num_seqs,
            pin_id=msg.pin_id,
            # Prompt logprobs need every position computed: no cache hits until then.
            read_prefix_cache=msg.params.prompt_logprobs is None or len(ids) < 2,
            fork_ids=tuple(next(self._seq_ids) for _ in range(num_seqs - 1)),
        )  # fmt: skip
        if msg.beam is not None:
            request.beam = BeamSearcher(
                width=msg.beam.beam_width,
                max_tokens=msg.beam.max_tokens,
                eos_token_ids=request.stop.eos_token_ids,
                length_penalty=msg.beam.length_penalty,
                early_stopping=msg.beam.early_stopping,
                ignore_eos=msg.beam.ignore_eos,
            )
            request.beam.start(request.seqs[0].seq_id)
        elif self._num_speculative and speculates(msg.params):
            request.num_speculative_tokens = self._num_speculative
        return request

    async def _compile_grammar(self, msg: SubmitRequest, text: str | None, opens: bool) -> Any:
        """Structured outputs: the request's compiled constraint (cached; None without one),
        compiled in the worker thread; whatever the compiler raises fails this request alone.
        A chat's tool-call grammar fits its rendered prompt ``text``: the thinking it opened
        (``opens``) goes on, an empty one it closed is not repeated."""
        constraint = msg.params.structured_outputs
        call_grammar = None if msg.chat is None else msg.chat.call_grammar
        if call_grammar is not None:
            end = None if call_grammar.reasoning is None else call_grammar.reasoning[1]
            closed = end is not None and text is not None and text.rstrip().endswith(end)
            constraint = call_grammar.constraint(in_reasoning=opens, thinking_closed=closed)
        if constraint is None:
            return None
        assert self._grammars is not None, "structured outputs without a grammar backend"
        grammars = self._grammars

        def compile_() -> Any:
            try:
                return grammars.compile(constraint)
            except InvalidRequestError:
                raise
            except Exception as exc:  # the grammar backend's own errors, per constraint
                raise InvalidRequestError(f"the constraint failed to compile: {exc!r}") from exc

        return await self.thread.run(compile_)


def speculates(params: Any) -> bool:
    """Whether speculative decoding serves a request: not with a grammar (its bitmask would be
    needed per proposal), logprobs, or best_of ranking by them (their rows are the plain
    path's), nor a thinking budget (kept proposals could run past it); beam search never
    speculates."""
    return (
        params.structured_outputs is None
        and params.logprobs is None
        and params.num_sequences == params.n
        and params.thinking_token_budget is None
    )


# Tokens decoded from a prompt of ids' end: its start marker and the whitespace after it
_REASONING_TAIL_TOKENS = 16


def ids_open_reasoning(
    reasoning: type[ReasoningParser], ids: Sequence[int], tokenizer: Any
) -> bool:
    """Whether a prompt of token ids opened a thinking block: ``prompt_opens_reasoning`` of its
    last tokens decoded (special tokens kept), a constant cost per prompt. A start marker
    followed by more whitespace than that many tokens hold is not seen."""
    tail = tokenizer.decode(list(ids[-_REASONING_TAIL_TOKENS:]), skip_special_tokens=False)
    return reasoning.prompt_opens_reasoning(str(tail))


def thread_copy(tokenizer: Any, model_path: Any) -> Any:
    """A copy of ``tokenizer`` for another thread (a deep copy; reloaded from ``model_path``
    if it cannot be copied)."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # any tokenizer class: reload it instead
        return load_tokenizer(model_path)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text)``; whatever it raises on this text (a lone surrogate: TypeError
    from a fast tokenizer) becomes InvalidRequestError for this request alone."""
    try:
        ids: list[int] = tokenizer.encode(text)
    except Exception as exc:
        raise InvalidRequestError(f"the tokenizer failed on this prompt: {exc!r}") from exc
    return ids


def render_chat(tokenizer: Any, chat: ChatPrompt) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation: the ids equal
    ``tokenizer.apply_chat_template(..., tokenize=True)`` (the rendered text tokenized without
    special tokens: the template writes them). A template that fails on this conversation (or
    a tokenizer without one), or a tokenizer that fails on the rendered text, raises
    InvalidRequestError for this request alone."""
    try:
        text = tokenizer.apply_chat_template(
            list(chat.messages),
            tools=None if chat.tools is None else list(chat.tools),
            chat_template=chat.chat_template,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            tokenize=False,
            **dict(chat.chat_template_kwargs),
        )
    except Exception as exc:  # jinja2 errors, ValueError for a missing template, user templates
        raise InvalidRequestError(f"the chat template failed on these messages: {exc}") from exc
    if not isinstance(text, str):
        raise InvalidRequestError(f"the chat template rendered {type(text).__name__}, not text.")
    try:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    except Exception as exc:  # a lone surrogate in a message, say
        raise InvalidRequestError(f"the tokenizer failed on this conversation: {exc!r}") from exc
    return text, ids
