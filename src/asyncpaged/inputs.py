"""Prompt forms, as vLLM accepts them, and chat messages (OpenAI's, made ready for a chat
template).

A prompt is a ``str``, a list of token ids, ``{"prompt": str}`` (:class:`TextPrompt`) or
``{"prompt_token_ids": [...]}`` (:class:`TokensPrompt`); either dict may carry a ``cache_salt``.
``parse_prompt`` checks the form and the element types before anything is queued; the token ids'
range and the prompt's length are checked by the engine against the model.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypeAlias, TypedDict

from asyncpaged.errors import InvalidRequestError

__all__ = [
    "ChatMessage",
    "ParsedPrompt",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "check_messages",
    "parse_prompt",
    "truncate_prompt",
]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (vLLM's ``TextPrompt``)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt already tokenized (vLLM's ``TokensPrompt``)."""

    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType: TypeAlias = str | Sequence[int] | TextPrompt | TokensPrompt
ChatMessage: TypeAlias = Mapping[str, Any]

_FORMS = (
    "a str, a list of token ids (int), {'prompt': str} or {'prompt_token_ids': [int, ...]} "
    "(each dict optionally with 'cache_salt')"
)


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """Exactly one of ``text`` and ``token_ids`` is set; ``cache_salt`` from a dict prompt."""

    text: str | None
    token_ids: tuple[int, ...] | None
    cache_salt: str | None = None


def _array_ids(ids: object) -> list[int] | None:
    """A 1-D numpy array or torch tensor of integers as a list of ints (``None`` for anything
    that is not an array); a float, bool or multi-dimensional array is refused."""
    dtype, ndim = getattr(ids, "dtype", None), getattr(ids, "ndim", None)
    if dtype is None or ndim is None or not hasattr(ids, "tolist"):
        return None
    name = str(dtype).removeprefix("torch.")
    if not name.startswith(("int", "uint")) or ndim != 1:
        raise InvalidRequestError(
            f"prompt token ids as an array must be 1-D integers, got {ndim}-D {name}."
        )
    out: list[int] = ids.tolist()
    return out


def _token_ids(ids: object, max_num_tokens: int | None) -> tuple[int, ...]:
    array = _array_ids(ids)
    if array is not None:
        ids = array
    elif isinstance(ids, str | bytes | bytearray | Mapping) or not isinstance(ids, Sequence):
        raise InvalidRequestError(f"a prompt must be {_FORMS}; got {type(ids).__name__}.")
    assert isinstance(ids, Sequence)
    if max_num_tokens is not None and len(ids) >= max_num_tokens:  # before an O(len) loop
        raise InvalidRequestError(
            f"prompt is {len(ids)} tokens; it must be shorter than max_model_len "
            f"({max_num_tokens})."
        )
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise InvalidRequestError(
                f"prompt token ids must be ints, got {type(t).__name__} ({t!r:.40})."
            )
        if getattr(t, "dtype", None) is not None and str(t.dtype).endswith("bool"):
            raise InvalidRequestError("prompt token ids must be ints, got a bool scalar.")
        out.append(operator.index(t))  # numpy / torch integer scalars included
    return tuple(out)


def parse_prompt(prompt: object, max_num_tokens: int | None = None) -> ParsedPrompt:
    """Check one of the accepted prompt forms; ``InvalidRequestError`` names them otherwise.
    Token ids may also be a 1-D integer numpy array or torch tensor. With ``max_num_tokens``
    (the model length, when the prompt is not truncated), a longer list of ids is refused by
    its length before its elements are looked at."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if not isinstance(prompt, Mapping):
        return ParsedPrompt(None, _token_ids(prompt, max_num_tokens))
    keys = set(prompt)
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError(f"cache_salt must be a str, got {type(salt).__name__}.")
    if keys in ({"prompt"}, {"prompt", "cache_salt"}):
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise InvalidRequestError(f"'prompt' must be a str, got {type(text).__name__}.")
        return ParsedPrompt(text, None, salt)
    if keys in ({"prompt_token_ids"}, {"prompt_token_ids", "cache_salt"}):
        return ParsedPrompt(None, _token_ids(prompt["prompt_token_ids"], max_num_tokens), salt)
    raise InvalidRequestError(f"a prompt must be {_FORMS}; got a dict with keys {sorted(keys)}.")


def truncate_prompt(token_ids: Sequence[int], params: Any) -> tuple[int, ...]:
    """The prompt's last ``params.truncate_prompt_tokens`` ids (all of them when unset)."""
    keep = params.truncate_prompt_tokens
    ids = tuple(token_ids)
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def check_messages(messages: object) -> list[dict[str, Any]]:
    """A chat conversation, checked and made ready for a chat template; returned as new plain
    dicts (the caller's are not changed).

    A non-empty list of dicts, each with a str ``role``. ``content`` is a str, None, or
    OpenAI's list of content parts: text parts (``{"type": "text", "text": ...}``) are joined
    with ``"\\n"`` into one str, as vLLM does for templates that take a str; any other part
    (``image_url``, ``input_audio``, ...) is refused, the model taking text only. An assistant
    message may carry ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``, ``content`` then None or absent): ``arguments`` given as a JSON string is
    parsed to a dict, as transformers' tool-use templates expect (an empty string is ``{}``, as
    in vLLM); an empty list is dropped. A ``role: "tool"`` message needs a str ``tool_call_id``.
    """
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
            f"{type(messages).__name__}."
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty.")
    return [_check_message(i, message) for i, message in enumerate(messages)]


def _check_message(i: int, message: object) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"messages[{i}] must be a dict with a str 'role'.")
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = _flatten_parts(i, content)
    elif content is not None and not isinstance(content, str):
        raise InvalidRequestError(
            f"messages[{i}]['content'] must be a str or a list of parts, got "
            f"{type(content).__name__}."
        )
    role = out["role"]
    if role == "tool" and not isinstance(out.get("tool_call_id"), str):
        raise InvalidRequestError(
            f"messages[{i}] has role 'tool' and needs a str 'tool_call_id' (the id of the "
            "assistant's tool call it answers)."
        )
    if out.get("tool_calls") is not None:
        if role != "assistant":
            raise InvalidRequestError(
                f"messages[{i}] has role {role!r}: only assistant messages carry tool_calls."
            )
        calls = out["tool_calls"]
        if not isinstance(calls, list):
            raise InvalidRequestError(
                f"messages[{i}]['tool_calls'] must be a list, got {type(calls).__name__}."
            )
        calls = [_check_tool_call(i, j, call) for j, call in enumerate(calls)]
        if calls:
            out["tool_calls"] = calls
        else:
            del out["tool_calls"]  # an empty list would steer templates off the plain path
    return out


def _flatten_parts(i: int, parts: list[Any]) -> str:
    """OpenAI's content parts as one str: the text parts joined with newlines."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{i}]['content'][{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{where} must be a dict with a str 'type'.")
        if kind != "text":
            raise InvalidRequestError(
                f"{where} is a {kind!r} part: this model takes text only (content parts of "
                "type 'text')."
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where} is a text part and needs a str 'text'.")
        texts.append(text)
    return "\n".join(texts)


def _check_tool_call(i: int, j: int, call: object) -> dict[str, Any]:
    """One of an assistant message's ``tool_calls``, its ``arguments`` as a dict."""
    where = f"messages[{i}]['tool_calls'][{j}]"
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"{where} must be a dict, got {type(call).__name__}.")
    if not isinstance(call.get("id"), str):
        raise InvalidRequestError(f"{where} needs a str 'id'.")
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}['type'] must be 'function', got {call['type']!r}.")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}['function'] must be a dict with a str 'name'.")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise InvalidRequestError(
                f"{where}['function']['arguments'] is not valid JSON: {exc}."
            ) from None
    elif arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(
            f"{where}['function']['arguments'] must be a JSON object (a str or a dict), got "
            f"{type(arguments).__name__}."
        )
    return {**call, "type": "function", "function": {**function, "arguments": dict(arguments)}}
