"""Request bodies of the OpenAI-compatible endpoints (OpenAI's field names, vLLM's extras), and
their translation into :class:`SamplingParams`.

Unknown fields are refused (as OpenAI does: "Unrecognized request argument"), so a misspelt
option never silently changes nothing. The chat fields OpenAI's clients send that this engine
has no use for by design (storage, billing, reasoning and verbosity hints:
``IGNORED_CHAT_FIELDS``) are accepted and ignored; a request for audio output is refused (the
model writes text). Fields of ``stream_options`` beyond the known ones are ignored: they only
shape a stream's extras. A field left out keeps the model's default (``generation_config.json``),
as in vLLM: only the fields given reach ``SamplingParams``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncpaged.errors import InvalidRequestError
from asyncpaged.sampling_params import RequestOutputKind, SamplingParams
from asyncpaged.structured_outputs import StructuredOutputsParams

__all__ = [
    "IGNORED_CHAT_FIELDS",
    "ChatCompletionRequest",
    "CompletionRequest",
    "to_sampling_params",
]

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs (vLLM's default max_logprobs)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI adds to these; none changes the text

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks: accepted, unused


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` body field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # accepted, unused
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputs | None = None
    cache_salt: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # top alternatives per token, 0..20
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; checked by
    # the engine (asyncpaged.tool_choice); None: "auto" with tools and a tool parser
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: one call at most where a grammar applies
    # OpenAI's fields this engine ignores by design (IGNORED_CHAT_FIELDS)
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None  # only ["text"]
    audio: dict[str, Any] | None = None  # audio output parameters: refused when given
    # vLLM's chat extras
    thinking_token_budget: int | None = None  # the thinking ends after this many tokens
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


IGNORED_CHAT_FIELDS = (
    "user", "reasoning_effort", "verbosity", "store", "metadata",
    "service_tier", "prediction", "web_search_options", "prompt_cache_key", "safety_identifier",
    "modalities", "audio",
)  # fmt: skip
"""Chat fields OpenAI's clients send that change nothing here: stored completions and their
metadata, billing tiers and ids, reasoning and verbosity hints (a model reasons as its chat
template and ``chat_template_kwargs`` say), predicted outputs (a speed hint), web search. Only
text comes out: ``modalities`` other than ``["text"]`` and ``audio`` are refused."""

_PASS_THROUGH = (
    "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
)  # fmt: skip


def to_sampling_params(
    body: CompletionRequest | ChatCompletionRequest, *, stream: bool, model_sets_max_tokens: bool
) -> SamplingParams:
    """The request's sampling parameters; ``InvalidRequestError`` names a bad value.

    A chat request without ``max_tokens`` / ``max_completion_tokens`` runs to the end of the
    context (as OpenAI and vLLM) unless the model's ``generation_config.json`` sets
    ``max_new_tokens``; a completion request's default is the model's (16 without one)."""
    given: dict[str, Any] = {
        name: value for name in _PASS_THROUGH if (value := getattr(body, name)) is not None
    }
    if body.stop is not None:
        given["stop"] = body.stop
    if body.logit_bias:
        given["logit_bias"] = _logit_bias(body.logit_bias)
    if isinstance(body, CompletionRequest):
        _check_completion_fields(body)
        if body.logprobs is not None:
            given["logprobs"] = _check_logprobs("logprobs", body.logprobs)
        if body.best_of is not None:
            given["best_of"] = body.best_of
        max_tokens = body.max_tokens
    else:
        _check_text_only(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true.")
        if body.logprobs:
            given["logprobs"] = _check_logprobs("top_logprobs", body.top_logprobs or 0)
        if body.thinking_token_budget is not None:
            given["thinking_token_budget"] = body.thinking_token_budget
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None and not model_sets_max_tokens:
            given["max_tokens"] = None  # chat: the rest of the context, as vLLM and OpenAI
    if max_tokens is not None:
        given["max_tokens"] = max_tokens
    constraint = _structured(body)
    if constraint is not None:
        given["structured_outputs"] = constraint
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(output_kind=kind, **given)


def _check_completion_fields(body: CompletionRequest) -> None:
    if body.suffix:
        raise InvalidRequestError("suffix is not supported.")
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo with logprobs is not supported (no prompt logprobs).")


def _check_text_only(body: ChatCompletionRequest) -> None:
    if body.modalities is not None and any(m != "text" for m in body.modalities):
        raise InvalidRequestError(
            f"modalities {body.modalities} is not supported: this model answers text only."
        )
    if body.audio is not None:
        raise InvalidRequestError("audio output is not supported: this model answers text only.")


def _check_logprobs(name: str, value: int) -> int:
    if not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
    return value


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}.") from None
        out[token] = min(100.0, max(-100.0, value))  # OpenAI's range
    return out


def _structured(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    fmt, extra = body.response_format, body.structured_outputs
    compact = extra is not None and extra.disable_any_whitespace
    if extra is not None and _has_constraint(extra):
        if fmt is not None and fmt.type != "text":
            raise InvalidRequestError("give response_format or structured_outputs, not both.")
        return StructuredOutputsParams(
            json=extra.json_, regex=extra.regex, choice=extra.choice, grammar=extra.grammar,
            json_object=extra.json_object, disable_any_whitespace=extra.disable_any_whitespace,
        )  # fmt: skip
    if fmt is None or fmt.type == "text":
        if extra is not None:
            raise InvalidRequestError(
                "structured_outputs needs one of json, regex, choice, grammar, json_object "
                "(disable_any_whitespace alone applies to a JSON response_format)."
            )
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise InvalidRequestError("response_format json_schema needs json_schema.schema.")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema, disable_any_whitespace=compact)


def _has_constraint(extra: StructuredOutputs) -> bool:
    """False for ``{"disable_any_whitespace": true}`` alone: it then applies to
    ``response_format``'s JSON."""
    kinds = (extra.json_, extra.regex, extra.choice, extra.grammar, extra.json_object)
    return any(k not in (None, False) for k in kinds)
