"""The tools a chat request offers and how its ``tool_choice`` binds the reply (OpenAI's fields).

``check_tools`` and ``check_tool_choice`` refuse malformed input before anything is queued.
``"none"`` and ``"auto"`` leave the reply free (``auto``: calls are parsed from it); ``"required"``
and a named function (``{"type": "function", "function": {"name": ...}}``) force calls with the
grammar engine, so a forced call always parses and its arguments validate against the tool's
``parameters`` schema. ``auto`` with tools marked ``"strict": true`` constrains a call's
arguments once the model starts one.

A forced call is written the way the model writes calls when its tool parser declares a
:class:`CallMarkup` (hermes, llama3_json, mistral): an xgrammar structural tag allows exactly
those calls, optionally after a thinking block. Without markup (pythonic, a parser of one's
own) the reply is a JSON value instead, as vLLM forces calls: the arguments object for a named
function, ``[{"name": ..., "parameters": {...}}, ...]`` for ``required``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from asyncpaged.errors import InvalidRequestError
from asyncpaged.structured_outputs import StructuredOutputsParams

__all__ = [
    "CallGrammar",
    "CallMarkup",
    "ForcedCalls",
    "ToolChoice",
    "check_tool_choice",
    "check_tools",
    "tool_name",
]

ToolChoice: TypeAlias = str | Mapping[str, Any] | None
"""``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": f}}``;
``None``: ``"auto"`` when the engine has a tool parser for the model, else ``"none"``."""

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace allowed in a row inside constrained arguments: a call's JSON as models write it
# (one line, or a little indentation), never a run that spends the reply's tokens on blanks.
MAX_WHITESPACE = 4


@dataclass(frozen=True, slots=True)
class CallMarkup:
    """How a tool-call format writes one call, for a grammar that forces calls: ``begin``
    (with ``{name}`` where the function's name goes), the arguments as a JSON object, ``end``;
    ``trigger`` is the text every call starts with (a prefix of ``begin``), ``separator`` what
    stands between two calls."""

    trigger: str
    begin: str
    end: str
    separator: str = ""

    def tag(self, name: str, schema: Mapping[str, Any]) -> dict[str, Any]:
        """xgrammar's tag for one call of ``name`` whose arguments follow ``schema``."""
        return {
            "type": "tag",
            "begin": self.begin.replace("{name}", name),
            "content": _json_content(schema),
            "end": self.end,
        }


@dataclass(frozen=True, slots=True)
class ForcedCalls:
    """A reply that must be tool calls: ``name`` for a named function (else any of the
    request's tools, at least one call), ``parallel``: more than one call allowed."""

    name: str | None
    parallel: bool = True


def _json_content(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": dict(schema),
        "max_whitespace_cnt": MAX_WHITESPACE,
    }


def tool_name(tool: Mapping[str, Any]) -> str:
    """The function name of a checked tool."""
    name: str = tool["function"]["name"]
    return name


def _schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return dict(parameters) if parameters else dict(_ANY_OBJECT)


def check_tools(tools: object) -> tuple[dict[str, Any], ...] | None:
    """``tools`` as OpenAI's shape (``[{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}]``), copied; InvalidRequestError for anything else: a tool without
    a name, a name that is not ``[A-Za-z0-9_.-]`` (at most 64), ``parameters`` that is not a
    JSON schema object, two tools of one name."""
    if tools is None:
        return None
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise InvalidRequestError("tools must be a list of tools.")
    checked: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"{where} must be an object.")
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type must be 'function', got {tool['type']!r}.")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{where}.function must be an object with a name.")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.function.name must be a non-empty string.")
        if len(name) > 64 or not all(ch.isascii() and (ch.isalnum() or ch in "_-.") for ch in name):
            raise InvalidRequestError(
                f"{where}.function.name {name!r} must be at most 64 of a-z, A-Z, 0-9, "
                "'_', '-', '.'."
            )
        if name in names:
            raise InvalidRequestError(f"{where}: two tools are named {name!r}.")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise InvalidRequestError(
                    f"{where}.function.parameters must be a JSON schema object."
                )
            if parameters.get("type", "object") != "object":
                raise InvalidRequestError(
                    f"{where}.function.parameters must describe an object (type 'object'), "
                    f"got type {parameters['type']!r}."
                )
            try:
                json.dumps(parameters)
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    f"{where}.function.parameters is not JSON: {exc}"
                ) from exc
        for key in ("description",):
            if function.get(key) is not None and not isinstance(function[key], str):
                raise InvalidRequestError(f"{where}.function.{key} must be a string.")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.function.strict must be a bool.")
        checked.append({**tool, "type": "function", "function": dict(function)})
    return tuple(checked)


def check_tool_choice(
    tool_choice: ToolChoice, tools: Sequence[Mapping[str, Any]] | None
) -> Literal["none", "auto"] | ForcedCalls | None:
    """``tool_choice`` against the checked ``tools``: ``"none"``, ``"auto"``, ``None`` (not
    given), or the :class:`ForcedCalls` of ``"required"`` or a named function (parallel calls
    allowed; the caller narrows that). InvalidRequestError for a choice that is none of these,
    a named function the tools lack, or a forced choice without tools."""
    if tool_choice is None:
        return None
    if isinstance(tool_choice, str) and tool_choice in ("none", "auto"):
        return "none" if tool_choice == "none" else "auto"
    names = [tool_name(t) for t in tools or ()]
    if tool_choice == "required":
        if not names:
            raise InvalidRequestError("tool_choice 'required' needs tools.")
        return ForcedCalls(name=None)
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}."
            )
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(names) or 'none given'})."
            )
        return ForcedCalls(name=name)
    raise InvalidRequestError(
        f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}."
    )


def _reasoning_prefix(
    reasoning: tuple[str, str] | None, in_reasoning: bool, thinking_closed: bool
) -> list[dict[str, Any]]:
    """The thinking block a constrained reply may start with: none without a reasoning parser
    or when the prompt closed one (a template's thinking switched off); the rest of an open
    block when the prompt opened it; else an optional whole block."""
    if reasoning is None or (thinking_closed and not in_reasoning):
        return []
    start, end = reasoning
    block = {"type": "tag", "begin": "" if in_reasoning else start,
             "content": {"type": "any_text"}, "end": end}  # fmt: skip
    if not in_reasoning:
        return [{"type": "optional", "content": block}]
    return [block]


def _forced_json_schema(tools: Sequence[Mapping[str, Any]], forced: ForcedCalls) -> dict[str, Any]:
    if forced.name is not None:
        return next(_schema(t) for t in tools if tool_name(t) == forced.name)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool_name(t)}, "parameters": _schema(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not forced.parallel:
        array["maxItems"] = 1
    return array


@dataclass(frozen=True, slots=True)
class CallGrammar:
    """The grammar of a chat reply's tool calls: ``choice`` forces calls, or (``"auto"``)
    constrains the strict tools' arguments once a call starts. ``tools`` are checked;
    ``markup``: how the model writes a call (None: forced calls are written as JSON);
    ``reasoning``: the (start, end) markers of the engine's reasoning parser, whose thinking
    block stays free; ``parallel``: more than one call allowed."""

    tools: tuple[dict[str, Any], ...]
    choice: ForcedCalls | Literal["auto"]
    markup: CallMarkup | None
    reasoning: tuple[str, str] | None = None
    parallel: bool = True

    @classmethod
    def of(
        cls,
        tools: tuple[dict[str, Any], ...],
        choice: ForcedCalls | Literal["auto"],
        markup: CallMarkup | None,
        *,
        reasoning: tuple[str, str] | None = None,
        parallel: bool = True,
    ) -> CallGrammar | None:
        """The grammar, or None when nothing is constrained (``auto`` without strict tools, or
        without markup to find a call's start by)."""
        if choice == "auto" and (
            markup is None or not any(t["function"].get("strict") is True for t in tools)
        ):
            return None
        return cls(tools, choice, markup, reasoning, parallel)

    def constraint(
        self, *, in_reasoning: bool = False, thinking_closed: bool = False
    ) -> StructuredOutputsParams:
        """As structured outputs; ``in_reasoning``: the prompt opened a thinking block;
        ``thinking_closed``: it ends with a closed one (no thinking in the reply)."""
        tools, markup = self.tools, self.markup
        prefix = _reasoning_prefix(self.reasoning, in_reasoning, thinking_closed)
        body: dict[str, Any]
        if self.choice == "auto":
            assert markup is not None
            tags = [
                markup.tag(tool_name(t), _schema(t) if t["function"].get("strict") else _ANY_OBJECT)
                for t in tools
            ]
            body = {"type": "triggered_tags", "triggers": [markup.trigger], "tags": tags,
                    "stop_after_first": not self.parallel}  # fmt: skip
        else:
            forced = ForcedCalls(self.choice.name, self.choice.parallel and self.parallel)
            if markup is None:
                body = _json_content(_forced_json_schema(tools, forced))
            elif forced.name is not None:
                schema = next(_schema(t) for t in tools if tool_name(t) == forced.name)
                body = markup.tag(forced.name, schema)
            else:
                body = {"type": "tags_with_separator", "separator": markup.separator,
                        "tags": [markup.tag(tool_name(t), _schema(t)) for t in tools],
                        "at_least_one": True, "stop_after_first": not forced.parallel}  # fmt: skip
        if prefix:  # the thinking first, free
            body = {"type": "sequence", "elements": [*prefix, body]}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": body})
