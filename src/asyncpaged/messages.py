"""Typed messages between the engine's actors (commands imperative, events past tense).

::

    engine.generate ──SubmitRequest──► Intake ──AddRequest──► Scheduler ──StepTxn──► Allocator
                                                    ▲  │  ▲ ◄─────────TxnResult───────┘
                                      StepDone ─────┘  │  └──── SwapDone ◄── SwapSpace
                                      (Executor) ◄─ExecuteStep   SwapBlocks ──►
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from asyncpaged.core.block_table import PinnedPrefix, SwapPlan
from asyncpaged.core.kv_tiers import TierOp
from asyncpaged.core.request import Request
from asyncpaged.core.scheduler import SchedulerOutput
from asyncpaged.model.runner import StepPlan, StepResult
from asyncpaged.sampling_params import BeamSearchParams, SamplingParams
from asyncpaged.streams import RequestState


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatPrompt:
    """A conversation to render with the tokenizer's chat template (``engine.chat``)."""

    messages: tuple[dict[str, Any], ...]
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[dict[str, Any], ...] | None = None
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitRequest:
    """A validated request whose prompt may still need rendering (chat) and tokenizing."""

    state: RequestState
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    chat: ChatPrompt | None = None
    params: SamplingParams
    cache_salt: str | None
    priority: int
    pin_id: int | None = None  # compute the prompt only to pin it (engine.pin_prefix)
    beam: BeamSearchParams | None = None  # a beam search (engine.beam_search)


@dataclass(frozen=True, slots=True, kw_only=True)
class AddRequest:
    request: Request
    state: RequestState


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequest:
    request_id: str
    # The request aborted (by its stream or engine.abort): only that one, never a later
    # request that reuses its id; None aborts whatever request holds the id (engine exit).
    state: RequestState | None = None


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
    cancelled); a pin its transaction still makes is released at once."""

    pin_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UnpinPrefix:
    pool_pin_id: int
    handled: anyio.Event  # set once the scheduler holds the unpin (then idle waits for it)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecuteStep:
    output: SchedulerOutput
    plan: StepPlan


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
    """Run one transaction's KV-tier copies (core/kv_tiers.py) in order, before its step;
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
