"""Llama 3.1/3.2's JSON tool calls: the whole reply is one or more call objects, separated by
``;``, optionally after the ``<|python_tag|>`` token::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that does not start (after whitespace and the python tag) with ``{`` is all content,
python tag included. A call's arguments are the text of its ``"parameters"`` (or
``"arguments"``) value as written. Whitespace and ``;`` between calls and after the last one
are dropped; any other text after a call is content from there to the end of the reply, as is
the text of a malformed call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum, auto
from typing import Any

from asyncpaged.tool_choice import CallMarkup
from asyncpaged.tool_parsers.base import ToolParseDelta, ToolParser
from asyncpaged.tool_parsers.delta_builder import DeltaBuilder
from asyncpaged.tool_parsers.json_call import JsonCall
from asyncpaged.tool_parsers.markers import WHITESPACE, is_partial_marker
from asyncpaged.tool_parsers.registry import register_tool_parser

__all__ = ["Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"


class _Mode(Enum):
    START = auto()  # the reply's beginning: whitespace and the python tag, held back
    OBJECT = auto()  # reading a call object
    SEPARATOR = auto()  # whitespace and one ";" after a call
    CONTENT = auto()  # the rest of the reply is content


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}; ...`` (see the module's doc)."""

    call_markup = CallMarkup('{"name": ', '{"name": "{name}", "parameters": ', "}", "; ")

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        new_call_id: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(tools, new_call_id=new_call_id)
        self._out = DeltaBuilder(self.new_call_id)
        self._mode = _Mode.START
        self._pending = ""
        self._call: JsonCall | None = None
        self._held = ""  # the separator after a call
        self._saw_semicolon = False

    def feed(self, text: str) -> ToolParseDelta:
        self._advance(text)
        if self._call is not None and self._mode is _Mode.OBJECT:
            self._call.flush(self._out)
        return self._out.take()

    def finish(self) -> ToolParseDelta:
        self._end()
        return self._out.take()

    def parse(self, text: str) -> ToolParseDelta:
        self._advance(text)
        return self.finish()

    def _advance(self, text: str) -> None:
        self._pending += text
        while True:
            p = self._pending
            if self._mode is _Mode.START:
                start = _call_start(p)
                if start is None:
                    return
                if start < 0:
                    self._mode = _Mode.CONTENT
                else:
                    self._start_call(p[:start])
                    self._pending = p[start:]
            elif self._mode is _Mode.OBJECT:
                assert self._call is not None
                self._pending = p[self._call.consume(p) :]
                if self._call.is_failed:
                    self._call.close(self._out)
                    self._mode = _Mode.CONTENT
                elif self._call.is_complete:
                    is_call = self._call.close(self._out)
                    self._mode = _Mode.SEPARATOR if is_call else _Mode.CONTENT
                    self._held, self._saw_semicolon = "", False
                else:
                    return
            elif self._mode is _Mode.SEPARATOR:
                i = 0
                while i < len(p) and (
                    p[i] in WHITESPACE or (p[i] == ";" and not self._saw_semicolon)
                ):
                    self._saw_semicolon |= p[i] == ";"
                    i += 1
                self._held += p[:i]
                self._pending = p[i:]
                if i == len(p):
                    return
                if p[i] == "{":
                    self._start_call(self._held)
                else:
                    self._out.add_content(self._held)
                    self._mode = _Mode.CONTENT
            else:
                self._out.add_content(p)
                self._pending = ""
                return

    def _start_call(self, prefix: str) -> None:
        self._call = JsonCall(prefix, self.is_known_tool)
        self._mode = _Mode.OBJECT

    def _end(self) -> None:
        rest, self._pending = self._pending, ""
        if self._mode is _Mode.OBJECT:
            assert self._call is not None
            self._call.close(self._out, rest)
        elif self._mode is not _Mode.SEPARATOR:
            self._out.add_content(rest)
        self._mode = _Mode.CONTENT


def _call_start(text: str) -> int | None:
    """Where the first call object starts in the reply's beginning ``text``; -1 when the reply
    is no call; None while that is not decided yet."""
    i = len(text) - len(text.lstrip(WHITESPACE))
    if text.startswith(PYTHON_TAG, i):
        i += len(PYTHON_TAG)
        i += len(text) - i - len(text[i:].lstrip(WHITESPACE))
    elif is_partial_marker(text[i:], PYTHON_TAG):
        return None
    if i == len(text):
        return None
    return i if text[i] == "{" else -1
