"""Whole tool calls from deltas: assembling a stream, and the non-streamed parse."""

from __future__ import annotations

from collections.abc import Iterable

from asyncpaged.outputs import ToolCall, ToolCallDelta
from asyncpaged.tool_parsers.base import ToolParser

__all__ = ["calls_from_deltas", "parse_tool_calls"]


def calls_from_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The calls that streamed ``deltas`` describe, by index: each call's id and name from its
    first delta, its arguments the concatenation of its fragments."""
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.index not in heads:
            if delta.id is None or delta.name is None:
                raise ValueError(f"the first delta of tool call {delta.index} has no id or name")
            heads[delta.index] = (delta.id, delta.name)
            arguments[delta.index] = []
        arguments[delta.index].append(delta.arguments)
    return [ToolCall(heads[i][0], heads[i][1], "".join(arguments[i])) for i in sorted(heads)]


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """The non-streamed parse of a whole reply by a fresh ``parser``: (content, calls)."""
    delta = parser.parse(text)
    return delta.content, calls_from_deltas(delta.tool_calls)
