"""The submission side of ``engine.generate``, ``engine.chat`` and ``engine.beam_search``: their
arguments checked and turned into what :class:`AsyncEngine` queues, the queueing
itself and a request's abort.

Every check here runs on the event loop before anything is built or queued for the request
(types, group width, sizes, then values; docs/api.md, "Request validation"); the checks
themselves live in ``request_checks.py`` and ``inputs.py``, this module only orders them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from asyncpaged.actors.messages import AbortRequest, ChatPrompt, SchedulerInbox, SubmitRequest
from asyncpaged.actors.output_processor import OutputProcessor
from asyncpaged.actors.scheduler import SchedulerActor
from asyncpaged.config import EngineConfig
from asyncpaged.errors import EngineClosedError, InvalidRequestError
from asyncpaged.inputs import ChatMessage, PromptType, check_messages, parse_prompt, truncate_prompt
from asyncpaged.model.generation_config import GenerationDefaults
from asyncpaged.reasoning import ReasoningParser
from asyncpaged.reply_parser import ReplyParsing
from asyncpaged.request_checks import (
    RequestLimits,
    check_cache_salt,
    check_group_width,
    check_request_id,
    check_text_prompt,
)
from asyncpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from asyncpaged.streams import RequestState, RequestStream
from asyncpaged.structured_outputs import EXTRA_HINT as STRUCTURED_EXTRA_HINT
from asyncpaged.structured_outputs import is_available as structured_outputs_available
from asyncpaged.tool_choice import CallGrammar, ForcedCalls, ToolChoice, check_tool_choice
from asyncpaged.tool_parsers import (
    ToolParser,
    get_tool_parser,
    tool_parser_for_template,
    tool_parser_names,
)

__all__ = [
    "abort_request",
    "beam_sampling_params",
    "chat_prompt",
    "chat_replies",
    "check_submission",
    "queue_request",
    "resolve_tool_parser",
    "submission",
    "submitted_prompt",
    "with_model_defaults",
]


def with_model_defaults(
    params: SamplingParams | None, defaults: GenerationDefaults
) -> SamplingParams:
    """``params`` with the fields the caller left unset taken from the model's defaults
    (``params=None``: the defaults themselves)."""
    if params is None:
        return defaults.sampling_params()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}.")
    return params.with_defaults(defaults.sampling)


def submitted_prompt(
    prompt: PromptType, cache_salt: str | None, max_model_len: int | None
) -> tuple[str | tuple[int, ...], str | None]:
    """A ``generate`` or ``beam_search`` prompt as (its text or token ids, its cache salt): the
    salt of a dict prompt or the ``cache_salt`` keyword, refused when given both ways; a list of
    ids longer than ``max_model_len`` (None: no limit, a prompt to be truncated) is refused."""
    parsed = parse_prompt(prompt, max_model_len)
    if parsed.cache_salt is not None and cache_salt is not None:
        raise InvalidRequestError("cache_salt is given twice (in the prompt and as keyword).")
    salt = cache_salt if parsed.cache_salt is None else parsed.cache_salt
    source = parsed.text if parsed.text is not None else parsed.token_ids
    assert source is not None
    return source, salt


def beam_sampling_params(params: BeamSearchParams, cfg: EngineConfig) -> SamplingParams:
    """The sampling parameters of a beam search's sequences (greedy, one final output), after
    its width is checked against the batch limits."""
    sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                              ignore_eos=params.ignore_eos, n=params.beam_width,
                              output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    check_group_width(params.beam_width, "beam_width", cfg.max_num_seqs,
                      cfg.max_num_batched_tokens)  # fmt: skip
    return sampling


def chat_prompt(
    messages: Sequence[ChatMessage],
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: tuple[dict[str, Any], ...] | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    call_grammar: CallGrammar | None = None,
) -> ChatPrompt:
    """``chat``'s arguments checked (``tools`` by ``check_tools``), as the prompt the intake
    renders."""
    checked = check_messages(messages)
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("continue_final_message=True needs add_generation_prompt=False.")
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidRequestError("chat_template must be a str (a Jinja template).")
    return ChatPrompt(
        messages=tuple(checked),
        chat_template=chat_template,
        add_generation_prompt=bool(add_generation_prompt),
        continue_final_message=bool(continue_final_message),
        tools=tools,
        chat_template_kwargs=tuple((chat_template_kwargs or {}).items()),
        call_grammar=call_grammar,
    )


def resolve_tool_parser(name: str | None, tokenizer: Any) -> type[ToolParser] | None:
    """``EngineConfig.tool_call_parser`` as a parser class: ``"auto"``, the one the tokenizer's
    chat template implies (None when it implies none); an unknown name raises
    InvalidRequestError."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None)
        name = tool_parser_for_template(template if isinstance(template, str) else None)
    return None if name is None else get_tool_parser(name)


def chat_replies(
    tools: tuple[dict[str, Any], ...] | None,
    tool_choice: ToolChoice,
    params: SamplingParams,
    *,
    parallel_tool_calls: bool,
    tool_parser: type[ToolParser] | None,
    reasoning: type[ReasoningParser] | None,
) -> tuple[ReplyParsing | None, CallGrammar | None, SamplingParams]:
    """How a chat request's replies are parsed, the grammar of its tool calls (None: free),
    and its parameters with that grammar's constraint (the one of a prompt that opens no
    thinking block; the intake compiles the one that fits the rendered prompt).

    ``tool_choice`` None is ``"auto"`` with tools and a parser, else ``"none"``; ``"auto"`` given
    without a parser is refused (the calls could not be found), and so are forced calls or
    strict tools together with ``structured_outputs``, one grammar per request."""
    choice = check_tool_choice(tool_choice, tools)
    if choice is None:
        choice = "auto" if tools and tool_parser is not None else "none"
    if choice == "auto" and tools and tool_parser is None:
        raise InvalidRequestError(
            "tool_choice 'auto' needs a tool call parser, and none matches this model's chat "
            f"template: name one (tool_call_parser=, one of {', '.join(tool_parser_names())})."
        )
    parser, forced_json, grammar = None, None, None
    if tools and choice != "none":
        markup = tool_parser.call_markup if tool_parser is not None else None
        markers = None if reasoning is None else (reasoning.start, reasoning.end)
        grammar = CallGrammar.of(tools, choice, markup, reasoning=markers,
                                 parallel=parallel_tool_calls)  # fmt: skip
        if isinstance(choice, ForcedCalls) and markup is None:
            forced_json = choice
        else:
            parser = tool_parser
    if grammar is not None:
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "structured_outputs cannot be combined with a forced tool_choice or strict "
                "tools (one grammar per request)."
            )
        params = params.replace(structured_outputs=grammar.constraint())
    if reasoning is None and parser is None and forced_json is None:
        return None, grammar, params
    parsing = ReplyParsing(reasoning=reasoning, tool_parser=parser, forced_json=forced_json,
                           tools=tools)  # fmt: skip
    return parsing, grammar, params


def check_submission(
    prompt: str | Sequence[int] | None,
    params: SamplingParams,
    request_id: str | None,
    cache_salt: str | None,
    *,
    is_beam: bool,
    live: Mapping[str, RequestState],
    cfg: EngineConfig,
    limits: RequestLimits,
    max_prompt_chars: int,
    has_reasoning_parser: bool = False,
) -> tuple[str, str | None, tuple[int, ...] | None]:
    """The request's id (a fresh one when None), text and token ids (one of them, or neither
    for a chat), once every check a request passes before it is queued has passed; ``live``:
    the requests submitted so far (an unfinished one's id is in use); ``has_reasoning_parser``:
    the engine knows its model's thinking markers (``thinking_token_budget`` needs them)."""
    rid = check_request_id(request_id if request_id is not None else f"req-{uuid.uuid4().hex[:12]}")
    check_cache_salt(cache_salt)
    if not is_beam:  # sizes before any per-sequence state is built
        what = "n" if params.best_of is None else "best_of"
        check_group_width(params.num_sequences, what, cfg.max_num_seqs,
                          cfg.max_num_batched_tokens)  # fmt: skip
    if rid in live and not live[rid].is_done:
        raise InvalidRequestError(f"request id {rid!r} is already in use.")
    limits.check_vocab(params)
    limits.check_logprobs(params)
    if params.logits_processors and cfg.executor_backend == "process":
        raise InvalidRequestError(
            "logits_processors run where the model runs: with executor_backend='process' (what "
            "the default, 'auto', takes on a CPU or CUDA device with 2+ cores) that is another "
            "process, which a callable (and its state) cannot follow; use "
            "EngineConfig(executor_backend='thread')."
        )
    if params.structured_outputs is not None and not structured_outputs_available():
        raise InvalidRequestError(STRUCTURED_EXTRA_HINT)
    if params.structured_outputs is not None and is_beam:
        raise InvalidRequestError("beam search does not take structured outputs.")
    if params.thinking_token_budget is not None and not has_reasoning_parser:
        raise InvalidRequestError(
            "thinking_token_budget needs a reasoning parser: this engine has none (set "
            "EngineConfig.reasoning_parser to one of asyncpaged.reasoning's names)."
        )
    if prompt is None:
        return rid, None, None
    if isinstance(prompt, str):
        check_text_prompt(prompt, max_prompt_chars, limits.max_model_len)
        return rid, prompt, None
    ids = truncate_prompt(tuple(prompt), params)
    limits.check_ids(ids, params)
    return rid, None, ids


def submission(
    prompt: str | Sequence[int] | None,
    params: SamplingParams,
    request_id: str | None,
    cache_salt: str | None,
    *,
    pin_id: int | None,
    beam: BeamSearchParams | None,
    chat: ChatPrompt | None,
    priority: int,
    live: Mapping[str, RequestState],
    cfg: EngineConfig,
    limits: RequestLimits,
    max_prompt_chars: int,
    reply_parsing: ReplyParsing | None = None,
    has_reasoning_parser: bool = False,
    lora: tuple[str, str] | None = None,
) -> SubmitRequest:
    """The checked request (:func:`check_submission`) as the intake's message, with its new
    :class:`RequestState` (``msg.state``); ``lora``: its adapter's digest and snapshot."""
    rid, text, ids = check_submission(
        prompt, params, request_id, cache_salt, is_beam=beam is not None, live=live, cfg=cfg,
        limits=limits, max_prompt_chars=max_prompt_chars,
        has_reasoning_parser=has_reasoning_parser,
    )  # fmt: skip
    state = RequestState(rid, text, params, time.monotonic(), beam=beam is not None,
                         reply_parsing=reply_parsing)  # fmt: skip
    return SubmitRequest(state=state, prompt=text, prompt_token_ids=ids, params=params,
                         cache_salt=cache_salt, priority=priority, pin_id=pin_id, beam=beam,
                         chat=chat, lora_key=None if lora is None else lora[0],
                         lora_path=None if lora is None else lora[1])  # fmt: skip


def queue_request(
    msg: SubmitRequest,
    outputs: OutputProcessor,
    submit: MemoryObjectSendStream[SubmitRequest],
    scheduler: SchedulerActor,
    abort: Callable[[RequestState], None],
) -> RequestStream:
    """Queue a checked request (:func:`submission`) for the intake, its state registered with
    the output processor first; its stream aborts it with ``abort``. A stopping engine's
    closed channel raises :class:`EngineClosedError` (and the state is not left live)."""
    state = msg.state
    outputs.register(state)
    try:
        submit.send_nowait(msg)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
        # A failing engine's actors stop before it marks itself dead: not queued, so the
        # caller hears that the engine is stopping (and the state is not left live).
        outputs.forget(state)
        raise EngineClosedError("the engine is not running: it is stopping.") from exc
    scheduler.expect_request()
    return RequestStream(state, abort, scheduler.dropped.append)


def abort_request(
    state: RequestState, control: MemoryObjectSendStream[SchedulerInbox], *, running: bool
) -> None:
    """Abort this request (not a later one that reuses its id): the flag makes the intake
    drop it if it is still there; the message reaches the scheduler otherwise (one loop,
    so one of the two sees it). ``running``: the engine has started and not failed (else the
    flag alone)."""
    if state.is_done or state.abort_requested:
        return
    state.abort_requested = True
    if running:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            # closed: every request has finished, nothing is left to abort
            msg = AbortRequest(request_id=state.request_id, serial=state.serial)
            control.send_nowait(msg)
