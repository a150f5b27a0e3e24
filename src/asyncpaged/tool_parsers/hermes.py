"""The Hermes tool-call format, used by Qwen2.5, Qwen3 and the Hermes models::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Text before the first call is content; whitespace between calls and after the last one is
dropped; other text after a call is content (with the whitespace before it). A call's
arguments are the text of its ``"arguments"`` value as the model wrote it (from ``{`` to ``}``,
whitespace and escapes kept); ``"parameters"`` is read the same way. A call whose JSON is
complete but whose ``</tool_call>`` never comes (the reply ended) is still a call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum, auto
from typing import Any

from asyncpaged.tool_choice import CallMarkup
from asyncpaged.tool_parsers.base import ToolParseDelta, ToolParser
from asyncpaged.tool_parsers.delta_builder import DeltaBuilder
from asyncpaged.tool_parsers.json_call import JsonCall
from asyncpaged.tool_parsers.markers import WHITESPACE, is_partial_marker, partial_marker_length
from asyncpaged.tool_parsers.registry import register_tool_parser

__all__ = ["HermesToolParser"]

START = "<tool_call>"
END = "</tool_call>"


class _Mode(Enum):
    CONTENT = auto()  # looking for <tool_call>
    BEFORE_OBJECT = auto()  # after <tool_call>, before the object's "{"
    OBJECT = auto()  # reading the call object
    AFTER_OBJECT = auto()  # after the object, before </tool_call>
    SKIP = auto()  # a malformed call: its text up to </tool_call> becomes content
    AFTER_CALL = auto()  # whitespace after a call, dropped unless content follows


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (see the module's doc)."""

    call_markup = CallMarkup(
        "<tool_call>", '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"
    )

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        new_call_id: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(tools, new_call_id=new_call_id)
        self._out = DeltaBuilder(self.new_call_id)
        self._mode = _Mode.CONTENT
        self._pending = ""  # text not read yet (a partial marker, or what follows a mode change)
        self._prefix = ""  # <tool_call> and the whitespace after it
        self._call: JsonCall | None = None
        self._tail = ""  # the text of the current call after its object (or after its prefix)
        self._held = ""  # whitespace after a call

    def feed(self, text: str) -> ToolParseDelta:
        self._advance(text)
        if self._call is not None and self._mode in (_Mode.OBJECT, _Mode.AFTER_OBJECT):
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
            if self._mode is _Mode.CONTENT:
                i = p.find(START)
                if i < 0:
                    keep = len(p) - partial_marker_length(p, START)
                    self._out.add_content(p[:keep])
                    self._pending = p[keep:]
                    return
                self._out.add_content(p[:i])
                self._pending = p[i + len(START) :]
                self._prefix, self._tail, self._call = START, "", None
                self._mode = _Mode.BEFORE_OBJECT
            elif self._mode is _Mode.BEFORE_OBJECT:
                rest = p.lstrip(WHITESPACE)
                self._prefix += p[: len(p) - len(rest)]
                self._pending = rest
                if not rest:
                    return
                if rest[0] == "{":
                    self._call = JsonCall(self._prefix, self.is_known_tool)
                    self._mode = _Mode.OBJECT
                else:
                    self._mode = _Mode.SKIP
            elif self._mode is _Mode.OBJECT:
                assert self._call is not None
                self._pending = p[self._call.consume(p) :]
                if self._call.is_failed:
                    self._mode = _Mode.SKIP
                elif self._call.is_complete:
                    self._mode = _Mode.AFTER_OBJECT
                else:
                    return
            elif self._mode is _Mode.AFTER_OBJECT:
                rest = p.lstrip(WHITESPACE)
                self._tail += p[: len(p) - len(rest)]
                self._pending = rest
                if rest.startswith(END):
                    self._pending = rest[len(END) :]
                    self._close_call(self._tail + END)
                elif is_partial_marker(rest, END):
                    return
                else:
                    self._mode = _Mode.SKIP
            elif self._mode is _Mode.SKIP:
                i = p.find(END)
                if i < 0:
                    keep = len(p) - partial_marker_length(p, END)
                    self._tail += p[:keep]
                    self._pending = p[keep:]
                    return
                self._tail += p[: i + len(END)]
                self._pending = p[i + len(END) :]
                self._close_call(self._tail)
            else:
                rest = p.lstrip(WHITESPACE)
                self._held += p[: len(p) - len(rest)]
                self._pending = rest
                if is_partial_marker(rest, START):
                    return
                if not rest.startswith(START):
                    self._out.add_content(self._held)
                self._held = ""
                self._mode = _Mode.CONTENT

    def _close_call(self, suffix: str) -> None:
        """The current call's text ended with ``suffix``: emit the call or its text."""
        if self._call is None:
            self._out.add_content(self._prefix + suffix)
            is_call = False
        else:
            is_call = self._call.close(self._out, suffix)
        self._call = None
        self._mode = _Mode.AFTER_CALL if is_call else _Mode.CONTENT

    def _end(self) -> None:
        rest, self._pending = self._pending, ""
        if self._mode is _Mode.CONTENT:
            self._out.add_content(rest)
        elif self._mode is _Mode.AFTER_CALL:
            if rest:
                self._out.add_content(self._held + rest)
        elif self._mode is _Mode.BEFORE_OBJECT:
            self._out.add_content(self._prefix + rest)
        else:  # a call without its </tool_call>: still a call if its object is complete
            self._close_call(self._tail + rest)
        self._mode = _Mode.CONTENT
