"""The intake actor: tokenizes text prompts off the event loop and hands requests on."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged.core.beam_search import BeamSearcher
from asyncpaged.core.request import Request, StopCriteria
from asyncpaged.core.request import Sequence as Seq
from asyncpaged.errors import InvalidRequestError
from asyncpaged.inputs import truncate_prompt
from asyncpaged.messages import AddRequest, ChatPrompt, SchedulerInbox, SubmitRequest
from asyncpaged.structured_outputs import GrammarBackend

log = structlog.get_logger("asyncpaged")


class IntakeActor:
    """Turns :class:`SubmitRequest` into the scheduler's :class:`AddRequest`.

    Chat conversations are rendered with the chat template and text prompts tokenized in a
    worker thread (one at a time: fast tokenizers are not re-entrant); a prompt that turns out
    invalid (too long, a template that fails on it) is rejected to its waiter and never reaches
    the scheduler.
    """

    def __init__(
        self,
        tokenizer: Any,
        validate_ids: Callable[[Sequence[int], Any], int],
        stop_criteria: Callable[[Any, int], StopCriteria],
        inbox: MemoryObjectReceiveStream[SubmitRequest],
        outbox: MemoryObjectSendStream[SchedulerInbox],
        seq_ids: Iterator[int],
        grammars: GrammarBackend | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._grammars = grammars
        self._validate_ids = validate_ids
        self._stop_criteria = stop_criteria
        self._inbox = inbox
        self._outbox = outbox
        self._limiter = anyio.CapacityLimiter(1)
        self._arrivals = itertools.count()
        self._seq_ids = seq_ids
        self._log = log.bind(actor="intake")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox, self._outbox:
            async for msg in self._inbox:
                try:
                    ids = truncate_prompt(await self._token_ids(msg), msg.params)
                    max_tokens = self._validate_ids(ids, msg.params)
                    await self._compile_grammar(msg)
                except InvalidRequestError as exc:
                    msg.state.reject(exc)
                    continue
                msg.state.start(list(ids), self.tokenizer)
                request = Request(
                    request_id=msg.state.request_id,
                    arrival=next(self._arrivals),
                    seqs=[
                        Seq(
                            seq_id=next(self._seq_ids),
                            index=0,
                            token_ids=list(ids),
                            num_prompt_tokens=len(ids),
                        )
                    ],
                    stop=self._stop_criteria(msg.params, max_tokens),
                    cache_salt=msg.cache_salt,
                    num_samples=msg.params.num_sequences if msg.beam is None else 1,
                    pin_id=msg.pin_id,
                    fork_ids=tuple(
                        next(self._seq_ids)
                        for _ in range(msg.params.num_sequences - 1 if msg.beam is None else 0)
                    ),
                )
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
                await self._outbox.send(AddRequest(request=request, state=msg.state))

    async def _compile_grammar(self, msg: SubmitRequest) -> None:
        """Structured outputs: compile the request's constraint (cached) in the worker thread."""
        constraint = msg.params.structured_outputs
        if constraint is None:
            return
        assert self._grammars is not None, "structured outputs without a grammar backend"
        grammars = self._grammars
        msg.state.grammar = await anyio.to_thread.run_sync(
            lambda: grammars.compile(constraint), limiter=self._limiter
        )

    async def _token_ids(self, msg: SubmitRequest) -> Sequence[int]:
        if msg.prompt_token_ids is not None:
            return msg.prompt_token_ids
        if msg.chat is not None:
            chat = msg.chat
            text, rendered = await anyio.to_thread.run_sync(
                lambda: render_chat(self.tokenizer, chat), limiter=self._limiter
            )
            msg.state.prompt = text
            return rendered
        assert msg.prompt is not None
        prompt = msg.prompt
        ids: list[int] = await anyio.to_thread.run_sync(
            lambda: self.tokenizer.encode(prompt), limiter=self._limiter
        )
        return ids


def render_chat(tokenizer: Any, chat: ChatPrompt) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation: the ids equal
    ``tokenizer.apply_chat_template(..., tokenize=True)`` (the rendered text tokenized without
    special tokens: the template writes them). A template that fails on this conversation (or
    a tokenizer without one) raises InvalidRequestError for this request alone."""
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
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return text, ids
