"""Typed messages between the engine's actors (commands imperative, events past tense).

::

    engine.generate ──SubmitRequest──► Intake ──AddRequest──► Scheduler ──StepTxn──► Allocator
                                         │          ▲  │  ▲ ◄─────────TxnResult───────┘
                          PromptReady, EndRequest   │  │  └──── SwapDone ◄── SwapSpace
                                         ▼  StepDone┘  │ ExecuteStep, DeliverLate,
                                         │             │ SwapBlocks ──►
                                  OutputProcessor ◄── RecordOutputs, EndRequest
                                                 └──► StopsFound (its reply to a stop check)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from asyncpaged.kv.block_table import PinnedPrefix, SwapPlan
from asyncpaged.kv.tiers import TierOp
from asyncpaged.sampling_params import BeamSearchParams, SamplingParams
from asyncpaged.sched.request import Request
from asyncpaged.sched.scheduler import EngineCoreOutput, SchedulerOutput
from asyncpaged.streams import RequestState
from asyncpaged.tool_choice import CallGrammar
from asyncpaged.worker.protocol import (
    LateDelivery,
    PromptLogprobRows,
    StepPlan,
    StepResult,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatPrompt:
    """A conversation to render with the tokenizer's chat template (``engine.chat``)."""

    messages: tuple[dict[str, Any], ...]
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[dict[str, Any], ...] | None = None
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    # the grammar of the reply's tool calls, compiled for the rendered prompt (tool_choice)
    call_grammar: CallGrammar | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitRequest:
    """A validated request whose prompt may still need rendering (chat) and tokenizing.
    ``state`` is read, never written, by the intake: its id, serial and ``abort_requested``
    (the output processor writes it)."""

    state: RequestState
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    chat: ChatPrompt | None = None
    params: SamplingParams
    cache_salt: str | None
    priority: int
    pin_id: int | None = None  # compute the prompt only to pin it (engine.pin_prefix)
    beam: BeamSearchParams | None = None  # a beam search (engine.beam_search)
    # LoRA: the adapter's content digest and the engine's snapshot of its files (None: base)
    lora_key: str | None = None
    lora_path: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestInfo:
    """What the scheduler actor needs of a request beyond the core's :class:`Request`, fixed
    when the intake hands it on: its parameters, its submission's serial (aborts name it),
    whether its rows take the plain greedy path, whether best_of ranks by logprob, its
    compiled grammar (structured outputs; the scheduler actor makes the matchers) and whether
    its prompt opened a thinking block (the engine's reasoning parser's
    ``prompt_opens_reasoning``; False without one)."""

    params: SamplingParams
    serial: int
    plain: bool
    ranks_by_logprob: bool
    prompt_token_ids: tuple[int, ...]  # the (truncated) prompt, for penalties and logprobs
    grammar: Any = None
    in_reasoning_at_start: bool = False
    lora_path: str | None = None  # the snapshot of the request's LoRA adapter (None: base)


@dataclass(frozen=True, slots=True, kw_only=True)
class AddRequest:
    request: Request
    info: RequestInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptReady:
    """The intake hands a request on: its prompt's token ids (and the rendered text of a chat),
    sent to the output processor before the ``AddRequest``, so its state is set up before any
    output of it exists."""

    request_id: str
    prompt: str | None  # a chat's rendered text (None: the state's prompt stands)
    prompt_token_ids: tuple[int, ...]
    in_reasoning_at_start: bool = False  # the prompt opened a thinking block (RequestInfo's)


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequest:
    request_id: str
    # The submission aborted (its RequestState.serial, from its stream or engine.abort): only
    # that one, never a later request that reuses its id.
    serial: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Scheduled:
    """A request's scheduling facts its outputs report: when it was first scheduled, and how
    many of its prompt tokens came from the prefix cache."""

    request_id: str
    first_scheduled_time: float
    num_cached_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordOutputs:
    """A step's outputs for the output processor to record into the requests' states.

    ``check_stops``: these are the tokens of requests with stop strings, sent before the next
    step is planned; the processor records them, keeps those states held (their readers see
    nothing new) and replies with :class:`StopsFound`. Otherwise it records them, then
    releases every held state and wakes the readers (sent once the next transaction has freed
    what finished: a reader never sees a finish before its blocks are free)."""

    tokens: tuple[EngineCoreOutput, ...] = ()
    prompt_logprobs: tuple[tuple[str, PromptLogprobRows], ...] = ()
    scheduled: tuple[Scheduled, ...] = ()
    # Finished beam searches: per request, its hypotheses (tokens, cumulative logprob,
    # ended at EOS), best first.
    beams: tuple[tuple[str, tuple[tuple[tuple[int, ...], float, bool], ...]], ...] = ()
    check_stops: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class EndRequest:
    """A request ended outside its outputs: aborted (``error`` None), or refused by the intake
    or failed alone in the scheduler (a logits processor raised): its waiter gets ``error``."""

    request_id: str
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StopsFound:
    """The output processor's reply to ``RecordOutputs(check_stops=True)``: the sequences
    whose text matched a stop string, as (request id, seq id, the stop string)."""

    matches: tuple[tuple[str, int, str], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchPin:
    """``engine.pin_prefix`` waits for pin ``pin_id``: the scheduler appends what its
    transaction pinned to ``slot`` and sets ``event`` (a reply channel, sent before the pin's
    request, so it is registered first)."""

    pin_id: int
    event: anyio.Event
    slot: list[PinnedPrefix | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ForgetPin:
    """The ``pin_prefix`` call of ``pin_id`` ended without its pin (refused, failed,
    cancelled) while its ``slot`` (the WatchPin's) was empty; a pin its transaction makes is
    released at once, also one handed out to ``slot`` after the call ended and before this
    message came."""

    pin_id: int
    slot: list[PinnedPrefix | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class UnpinPrefix:
    pool_pin_id: int
    handled: anyio.Event  # set once the scheduler holds the unpin (then idle waits for it)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecuteStep:
    """Run one step; ``executed`` is set once the runner is done with it (before its
    ``StepDone`` is queued: KV-tier copies planned meanwhile wait for it)."""

    output: SchedulerOutput
    plan: StepPlan
    executed: anyio.Event


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliverLate:
    """The late sampling inputs of the late rows of the step sent last (``late_inputs``),
    sent once the step before it is back; the runner takes them before it samples."""

    delivery: LateDelivery


ExecutorInbox = ExecuteStep | DeliverLate


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDone:
    step_id: int
    result: StepResult
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapBlocks:
    plan: SwapPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyTierBlocks:
    """Run one transaction's KV-tier copies (kv/tiers.py) in order, before its step;
    ``done`` is set once they have landed."""

    ops: tuple[TierOp, ...]
    done: anyio.Event


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapDone:
    swap_id: int


SchedulerInbox = (
    AddRequest | AbortRequest | StepDone | SwapDone | WatchPin | ForgetPin | UnpinPrefix
)
SwapSpaceInbox = SwapBlocks | CopyTierBlocks
OutputsInbox = PromptReady | RecordOutputs | EndRequest
