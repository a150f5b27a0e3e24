"""What the engine hands back for a request, with vLLM's class and field names.

The classes are plain mutable dataclasses (as in vLLM): the engine builds a fresh object for each
streamed output, and a consumer that lags behind may merge several into one with
:meth:`RequestOutput.add`. How much each output carries (everything so far, only what is new, or
only the final result) is chosen per request by ``SamplingParams.output_kind``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
    "ToolCall",
    "ToolCallDelta",
]

FinishReason: TypeAlias = Literal["stop", "length", "abort", "tool_calls"]
"""Why a sequence ended: ``"stop"`` (EOS, a stop token id or a stop string), ``"length"``
(``max_tokens`` or the model's context length), ``"abort"`` (cancelled by the client or the
host), ``"tool_calls"`` (a chat turn that stopped as ``"stop"`` would, with at least one tool
call parsed from its text)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call parsed from a chat reply (OpenAI's ``tool_calls[i]``): ``arguments`` is
    the call's arguments as JSON text, as the model wrote them (OpenAI's ``arguments``)."""

    id: str
    name: str
    arguments: str
    type: Literal["function"] = "function"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """What is new of the tool call number ``index`` (0, 1, ... in the reply) since the previous
    output, as OpenAI streams ``delta.tool_calls``: the first delta of a call carries its ``id``
    and ``name``; later ones ``None`` there and a fragment of ``arguments`` (JSON text; the
    fragments of one call concatenate to its arguments)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Logprob:
    """The log probability of one token at one position.

    ``rank`` is the token's 1-based position when the vocabulary is sorted by probability
    (1 = most likely); ``decoded_token`` is its text, when the engine detokenized it.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs: TypeAlias = list[dict[int, Logprob]]
"""One dict per output token: token id -> Logprob, holding the sampled token and the top
``SamplingParams.logprobs`` alternatives (so one or two more entries than asked)."""

PromptLogprobs: TypeAlias = list[dict[int, Logprob] | None]
"""One entry per prompt position (vLLM's): ``None`` for the first token, then a dict holding the
prompt token at that position (its logprob given the tokens before it, and its rank) and the top
``SamplingParams.prompt_logprobs`` tokens there (ranks 1..k)."""


@dataclass(slots=True)
class CompletionOutput:
    """One output sequence of a request.

    With ``RequestOutputKind.DELTA``, ``text``, ``token_ids`` and ``logprobs`` hold only what is
    new since the previous output of this sequence; otherwise everything so far.
    ``cumulative_logprob`` is always the sum over all tokens so far (``None`` unless logprobs
    were requested). ``stop_reason`` is the stop string or stop token id that ended the sequence;
    ``None`` when it ended on EOS, on length, by abort, or has not ended.

    A chat reply parsed by a reasoning parser or a tool parser (``engine.chat``; docs/api.md,
    "Tool calls and reasoning") has ``text`` without the markup: ``reasoning`` holds the
    thinking (``None`` without a reasoning parser), ``tool_calls`` the calls parsed so far
    (``None`` when none; in a CUMULATIVE output before the end, the last one's ``arguments``
    may still be incomplete) and, with ``RequestOutputKind.DELTA``, ``tool_call_deltas`` what is
    new of them (``tool_calls`` is then ``None``); ``reasoning`` is a delta there too.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_deltas: list[ToolCallDelta] | None = None

    def finished(self) -> bool:
        """True once the sequence has ended (``finish_reason`` is set)."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps and counters of one request.

    Times are seconds on one clock chosen by the engine (only differences are meaningful);
    ``None`` until the event happens. ``num_preemptions`` counts how often the request lost its
    KV cache blocks and had to be recomputed or swapped back in.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    @property
    def time_in_queue_s(self) -> float | None:
        """From arrival to first being scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token_s(self) -> float | None:
        """From arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency_s(self) -> float | None:
        """From arrival to finishing."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """One output of a request: its prompt and one ``CompletionOutput`` per sequence.

    ``finished`` is True in the last output of the request (every sequence has ended, or the
    request was aborted). ``num_cached_tokens`` is how many prompt tokens were served from the
    prefix cache, when known. ``prompt_logprobs`` (``None`` unless
    ``SamplingParams.prompt_logprobs`` was set) comes whole with the first output; with
    ``RequestOutputKind.DELTA`` only the first output has it, later ones an empty list (vLLM's).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, next_output: RequestOutput, *, aggregate: bool) -> None:
        """Merge a later output of the same request into this one, in place (vLLM's ``add``).

        ``aggregate=True`` is for DELTA outputs: text, token ids and logprobs are appended;
        cumulative logprob, finish and stop reasons are taken from ``next_output``.
        ``aggregate=False`` is for CUMULATIVE outputs: each sequence is replaced. Sequences new
        in ``next_output`` are appended. ``finished`` becomes True if either is; ``metrics`` and
        ``num_cached_tokens`` are taken from ``next_output`` when it has them, and
        ``prompt_logprobs`` when this output has none (they come once, whole).
        """
        assert next_output.request_id == self.request_id, (
            f"cannot merge output of {next_output.request_id!r} into {self.request_id!r}"
        )
        self.finished |= next_output.finished
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        if not self.prompt_logprobs and next_output.prompt_logprobs is not None:
            self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {completion.index: i for i, completion in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                by_index[new.index] = len(self.outputs)
                self.outputs.append(new)
            elif aggregate:
                _append_delta(self.outputs[i], new)
            else:
                self.outputs[i] = new


def _append_delta(completion: CompletionOutput, delta: CompletionOutput) -> None:
    completion.text += delta.text
    completion.token_ids = [*completion.token_ids, *delta.token_ids]
    if delta.logprobs is not None:
        completion.logprobs = [*(completion.logprobs or []), *delta.logprobs]
    if delta.reasoning is not None:
        completion.reasoning = (completion.reasoning or "") + delta.reasoning
    if delta.tool_call_deltas is not None:
        earlier = completion.tool_call_deltas or []
        completion.tool_call_deltas = [*earlier, *delta.tool_call_deltas]
    completion.cumulative_logprob = delta.cumulative_logprob
    completion.finish_reason = delta.finish_reason
    completion.stop_reason = delta.stop_reason
