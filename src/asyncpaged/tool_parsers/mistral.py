"""Mistral's tool calls, in both of its forms::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}

The first is the older models' (a JSON list of call objects; a single object without the list
is read too), the second the newer ones' (``[TOOL_CALLS]`` before each call). Text before
``[TOOL_CALLS]`` is content; whitespace between calls and after the last one is dropped; other
text after a call is content (with the whitespace before it). A call's arguments are the text
of its arguments object as written. Call ids are Mistral's 9 letters and digits by default.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from enum import Enum, auto
from typing import Any

from asyncpaged.tool_choice import CallMarkup
from asyncpaged.tool_parsers.base import ToolParseDelta, ToolParser
from asyncpaged.tool_parsers.call_ids import mistral_call_id
from asyncpaged.tool_parsers.delta_builder import DeltaBuilder
from asyncpaged.tool_parsers.json_call import JsonCall
from asyncpaged.tool_parsers.markers import WHITESPACE, is_partial_marker, partial_marker_length
from asyncpaged.tool_parsers.registry import register_tool_parser

__all__ = ["MistralToolParser"]

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")


class _Mode(Enum):
    CONTENT = auto()  # looking for [TOOL_CALLS]
    AFTER_MARKER = auto()  # after [TOOL_CALLS]: "[", "{" or a name follows
    LIST_BEFORE_OBJECT = auto()  # in the list, before a call object (or its "]")
    LIST_AFTER_OBJECT = auto()  # in the list, after a call object: "," or "]"
    OBJECT = auto()  # reading a call object, or the arguments object after [ARGS]
    NAME = auto()  # reading the name before [ARGS]
    BEFORE_ARGUMENTS = auto()  # after [ARGS], before its "{"
    AFTER_CALL = auto()  # whitespace after a call, dropped unless content follows


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` and ``[TOOL_CALLS]name[ARGS]{...}`` (see the module's doc);
    forced calls are written the newer way."""

    call_markup = CallMarkup("[TOOL_CALLS]", "[TOOL_CALLS]{name}[ARGS]", "", "")

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        new_call_id: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(tools, new_call_id=new_call_id)
        self._out = DeltaBuilder(self.new_call_id)
        self._mode = _Mode.CONTENT
        self._pending = ""
        self._prefix = ""  # the markup read since the last call (or since [TOOL_CALLS])
        self._name = ""
        self._in_list = False
        self._num_listed = 0  # calls read in the current list
        self._call: JsonCall | None = None
        self._held = ""

    @staticmethod
    def default_call_id() -> str:
        return mistral_call_id()

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
            mode = self._mode
            if mode is _Mode.CONTENT:
                i = p.find(TOOL_CALLS)
                if i < 0:
                    keep = len(p) - partial_marker_length(p, TOOL_CALLS)
                    self._out.add_content(p[:keep])
                    self._pending = p[keep:]
                    return
                self._out.add_content(p[:i])
                self._pending = p[i + len(TOOL_CALLS) :]
                self._prefix, self._in_list, self._mode = TOOL_CALLS, False, _Mode.AFTER_MARKER
            elif mode is _Mode.AFTER_CALL:
                rest = p.lstrip(WHITESPACE)
                self._held += p[: len(p) - len(rest)]
                self._pending = rest
                if is_partial_marker(rest, TOOL_CALLS):
                    return
                if not rest.startswith(TOOL_CALLS):
                    self._out.add_content(self._held)
                self._held = ""
                self._mode = _Mode.CONTENT
            elif mode is _Mode.OBJECT:
                assert self._call is not None
                self._pending = p[self._call.consume(p) :]
                if not self._call.is_complete and not self._call.is_failed:
                    return
                if not self._call.close(self._out):
                    self._mode = _Mode.CONTENT
                elif self._in_list:
                    self._num_listed += 1
                    self._prefix, self._mode = "", _Mode.LIST_AFTER_OBJECT
                else:
                    self._mode = _Mode.AFTER_CALL
            elif mode is _Mode.NAME:
                run = _NAME_CHARS.match(p)
                assert run is not None
                self._name += run.group()
                rest = self._pending = p[run.end() :]
                if is_partial_marker(rest, ARGS):
                    return
                if not rest.startswith(ARGS) or not self._name:
                    self._fail(self._name)
                    continue
                self._prefix += self._name + ARGS
                self._pending = rest[len(ARGS) :]
                self._mode = _Mode.BEFORE_ARGUMENTS
            else:
                rest = p.lstrip(WHITESPACE)
                self._prefix += p[: len(p) - len(rest)]
                self._pending = rest
                if not rest:
                    return
                self._after_markup(rest[0])

    def _after_markup(self, c: str) -> None:
        """Decide what the next non-whitespace character ``c`` means in the markup modes."""
        mode = self._mode
        if mode is _Mode.AFTER_MARKER:
            if c == "[":
                self._pending = self._pending[1:]
                self._prefix += c
                self._in_list, self._num_listed = True, 0
                self._mode = _Mode.LIST_BEFORE_OBJECT
            elif c == "{":
                self._start_call()
            elif self._prefix == TOOL_CALLS:
                self._name, self._mode = "", _Mode.NAME
            else:
                self._fail()
        elif mode is _Mode.LIST_BEFORE_OBJECT:
            if c == "{":
                self._start_call()
            elif c == "]" and self._num_listed:  # a trailing comma, read leniently
                self._pending = self._pending[1:]
                self._mode = _Mode.AFTER_CALL
            else:
                self._fail()
        elif mode is _Mode.LIST_AFTER_OBJECT:
            if c in ",]":
                self._pending = self._pending[1:]
                self._prefix += c
                self._mode = _Mode.LIST_BEFORE_OBJECT if c == "," else _Mode.AFTER_CALL
            else:
                self._out.add_content(self._prefix)
                self._mode = _Mode.CONTENT
        elif c == "{":  # BEFORE_ARGUMENTS
            self._start_call(self._name)
        else:
            self._fail()

    def _start_call(self, name: str | None = None) -> None:
        self._call = JsonCall(self._prefix, self.is_known_tool, name=name)
        self._mode = _Mode.OBJECT

    def _fail(self, extra: str = "") -> None:
        """The markup since the last call is not a call: it becomes content."""
        self._out.add_content(self._prefix + extra)
        self._mode = _Mode.CONTENT

    def _end(self) -> None:
        rest, self._pending = self._pending, ""
        mode = self._mode
        if mode is _Mode.OBJECT:
            assert self._call is not None
            self._call.close(self._out, rest)
        elif mode is _Mode.AFTER_CALL:
            if rest:
                self._out.add_content(self._held + rest)
        elif mode is _Mode.NAME:
            self._out.add_content(self._prefix + self._name + rest)
        elif mode in (_Mode.AFTER_MARKER, _Mode.BEFORE_ARGUMENTS) or (
            mode is _Mode.LIST_BEFORE_OBJECT and not self._num_listed
        ):
            self._out.add_content(self._prefix + rest)
        elif mode is _Mode.CONTENT:
            self._out.add_content(rest)
        # else: a list of calls missing its "]" (and maybe ending in ","): the calls stand
        self._mode = _Mode.CONTENT
