"""Pythonic tool calls (Llama 3.2 and Llama 4): the whole reply is a Python list of calls with
keyword arguments, optionally between ``<|python_start|>`` and ``<|python_end|>``::

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

Argument values are Python literals (str, int, float, bool, None, and lists, tuples and dicts
of them); a call's arguments are ``json.dumps`` of them as a dict (``ensure_ascii=False``, the
default separators). A call streams out whole once its ``)`` is read. A reply that does not
start (after whitespace and the python-start tag) with ``[`` is all content; so is, in the
non-streamed parse, a reply whose list is not a list of such calls. Streamed, the calls before
the first malformed one stand and the text from there on is content. Whitespace and
``<|python_end|>`` after the list are dropped; other text after it is content.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum, auto
from typing import Any

from asyncpaged.tool_parsers.base import ToolParseDelta, ToolParser
from asyncpaged.tool_parsers.delta_builder import DeltaBuilder
from asyncpaged.tool_parsers.markers import WHITESPACE, is_partial_marker
from asyncpaged.tool_parsers.python_call import PythonCallScanner, python_call_to_json
from asyncpaged.tool_parsers.registry import register_tool_parser

__all__ = ["PythonicToolParser"]

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class _Mode(Enum):
    START = auto()  # the reply's beginning, held back until "[" or something else shows
    BEFORE_CALL = auto()  # in the list, before a call (or the "]" after a trailing comma)
    CALL = auto()  # reading a call
    AFTER_CALL = auto()  # in the list, after a call: "," or "]"
    AFTER_LIST = auto()  # whitespace and <|python_end|>, dropped unless content follows
    CONTENT = auto()  # the rest of the reply is content


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """``[f(a=1), g(b="x")]`` (see the module's doc)."""

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
        self._unsettled = ""  # the reply's text since the last call, not yet content
        self._call = PythonCallScanner()
        self._is_malformed = False

    def feed(self, text: str) -> ToolParseDelta:
        self._advance(text)
        return self._out.take()

    def finish(self) -> ToolParseDelta:
        self._end()
        return self._out.take()

    def parse(self, text: str) -> ToolParseDelta:
        self._advance(text)
        delta = self.finish()
        return ToolParseDelta(text) if self._is_malformed else delta

    def _advance(self, text: str) -> None:
        self._pending += text
        while True:
            p = self._pending
            mode = self._mode
            if mode is _Mode.CALL:
                self._pending = p[self._call.consume(p) :]
                if self._call.is_failed:
                    self._malformed()
                elif self._call.is_complete:
                    self._call_complete()
                else:
                    return
            elif mode is _Mode.CONTENT:
                self._out.add_content(p)
                self._pending = ""
                return
            elif mode is _Mode.START:
                start = _list_start(p)
                if start is None:
                    return
                if start < 0:
                    self._mode = _Mode.CONTENT
                else:
                    self._unsettled, self._pending = p[:start], p[start:]
                    self._mode = _Mode.BEFORE_CALL
            else:
                rest = p.lstrip(WHITESPACE)
                self._unsettled += p[: len(p) - len(rest)]
                self._pending = rest
                if mode is _Mode.AFTER_LIST:
                    if rest.startswith(PYTHON_END):
                        self._unsettled += PYTHON_END
                        self._pending = rest = rest[len(PYTHON_END) :]
                        continue
                    if is_partial_marker(rest, PYTHON_END):
                        return
                    self._out.add_content(self._unsettled)
                    self._mode = _Mode.CONTENT
                elif not rest:
                    return
                elif mode is _Mode.BEFORE_CALL:
                    if rest[0] == "]" and self._out.num_calls:  # after a trailing comma
                        self._end_list()
                    elif rest[0] == "]" or not (rest[0].isalpha() or rest[0] == "_"):
                        self._malformed()
                    else:
                        self._call = PythonCallScanner()
                        self._mode = _Mode.CALL
                elif rest[0] in ",]":  # AFTER_CALL
                    if rest[0] == "]":
                        self._end_list()
                    else:
                        self._unsettled += ","
                        self._pending = rest[1:]
                        self._mode = _Mode.BEFORE_CALL
                else:
                    self._malformed()

    def _call_complete(self) -> None:
        parsed = python_call_to_json(self._call.text)
        if parsed is None or not self.is_known_tool(parsed[0]):
            self._malformed()
            return
        self._out.start_call(*parsed)
        self._call = PythonCallScanner()
        self._unsettled = ""
        self._mode = _Mode.AFTER_CALL

    def _end_list(self) -> None:
        self._unsettled = ""
        self._pending = self._pending[1:]
        self._mode = _Mode.AFTER_LIST

    def _malformed(self) -> None:
        """The list is not (or no longer) a list of calls: the rest of the reply is content."""
        self._is_malformed = True
        self._out.add_content(self._unsettled + self._call.text)
        self._call = PythonCallScanner()
        self._mode = _Mode.CONTENT

    def _end(self) -> None:
        if self._mode is _Mode.AFTER_LIST:
            if self._pending:
                self._out.add_content(self._unsettled + self._pending)
        elif self._mode in (_Mode.START, _Mode.CONTENT):
            self._out.add_content(self._pending)
        else:  # the list never ended
            self._malformed()
            self._out.add_content(self._pending)
        self._pending = ""
        self._mode = _Mode.CONTENT


def _list_start(text: str) -> int | None:
    """Where the list starts in the reply's beginning ``text`` (the index after its "["); -1
    when the reply is no list; None while that is not decided yet."""
    i = len(text) - len(text.lstrip(WHITESPACE))
    if text.startswith(PYTHON_START, i):
        i += len(PYTHON_START)
        i += len(text) - i - len(text[i:].lstrip(WHITESPACE))
    elif is_partial_marker(text[i:], PYTHON_START):
        return None
    if i == len(text):
        return None
    return i + 1 if text[i] == "[" else -1
