"""An incremental scanner of one JSON object: it reads the object's text in pieces of any size,
knows where the object ends, and where each top-level member's value starts and ends, while
the text is still arriving.

It checks the structure (brackets, strings and their escapes, commas, colons, the spelling of
numbers and literals) well enough to find those boundaries; whoever uses the object still
decodes it with :func:`json.loads` once it is complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from asyncpaged.tool_parsers.markers import WHITESPACE

__all__ = ["JsonObjectScanner", "Member"]

_SCALAR_CHARS = frozenset("-+.0123456789eEtrufalsn")
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_STRING_STOP = re.compile(r'["\\]')

# What the innermost open container (or the top, before the object) expects next.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)


@dataclass(slots=True)
class Member:
    """A top-level member of the object: its decoded key, and where its value's text starts and
    ends (``value_end`` is ``None`` while the value is still being read)."""

    key: str
    value_start: int
    value_end: int | None = None


class JsonObjectScanner:
    """Reads one JSON object, ``{`` first, in pieces (:meth:`consume`).

    Invariants: ``text`` is everything consumed, and ends with the object's closing ``}`` once
    ``is_complete``; a member's value text is ``text[value_start:value_end]`` (from its first
    character to its last; while it is read, everything from ``value_start`` on belongs to it);
    once ``is_failed`` or ``is_complete``, nothing more is consumed.
    """

    def __init__(self) -> None:
        self.text = ""
        self.members: list[Member] = []
        self.is_complete = False
        self.is_failed = False
        self._open: list[str] = []  # the open containers, "{" or "["
        self._expect = _VALUE
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._string_is_key = False
        self._in_scalar = False
        self._scalar_start = 0
        self._key = ""

    def consume(self, text: str) -> int:
        """Read ``text`` up to the end of the object or the first character that cannot belong
        to it; return how many characters were read."""
        base = len(self.text)
        s = self.text + text
        i = base
        n = len(s)
        while i < n and not self.is_complete and not self.is_failed:
            if self._in_string:
                if self._escape:
                    self._escape = False
                    i += 1
                    continue
                stop = _STRING_STOP.search(s, i)
                if stop is None:
                    i = n
                    break
                i = stop.start() + 1
                if s[i - 1] == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                    self._string_ended(s, i)
                continue
            c = s[i]
            if self._in_scalar:
                if c in _SCALAR_CHARS:
                    i += 1
                    continue
                self._in_scalar = False
                self._scalar_ended(s, i)
                continue
            if c in WHITESPACE:
                i += 1
                continue
            self._structural(c, i)
            if not self.is_failed:
                i += 1
        self.text = s[:i]
        return i - base

    def _structural(self, c: str, i: int) -> None:
        expect = self._expect
        wants_value = expect in (_VALUE, _VALUE_OR_CLOSE)
        if c == '"':
            if expect in (_KEY, _KEY_OR_CLOSE):
                self._string_is_key = True
            elif wants_value and self._open:
                self._string_is_key = False
                self._value_started(i)
            else:
                self.is_failed = True
                return
            self._in_string = True
            self._string_start = i
        elif c in "{[":
            if not wants_value or (not self._open and c != "{"):
                self.is_failed = True
                return
            if self._open:
                self._value_started(i)
            self._open.append(c)
            self._expect = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
        elif c in "}]":
            closes = "{" if c == "}" else "["
            can_close = expect in (_COMMA_OR_CLOSE, _KEY_OR_CLOSE, _VALUE_OR_CLOSE)
            if not self._open or self._open[-1] != closes or not can_close:
                self.is_failed = True
                return
            self._open.pop()
            self._value_ended(i + 1)
        elif c == ",":
            if expect != _COMMA_OR_CLOSE:
                self.is_failed = True
                return
            self._expect = _KEY if self._open[-1] == "{" else _VALUE
        elif c == ":":
            if expect != _COLON:
                self.is_failed = True
                return
            self._expect = _VALUE
        elif c in _SCALAR_CHARS and wants_value and self._open:
            self._in_scalar = True
            self._scalar_start = i
            self._value_started(i)
        else:
            self.is_failed = True

    def _value_started(self, i: int) -> None:
        if len(self._open) == 1:
            self.members.append(Member(self._key, i))

    def _value_ended(self, end: int) -> None:
        if not self._open:
            self.is_complete = True
            return
        self._expect = _COMMA_OR_CLOSE
        if len(self._open) == 1:
            self.members[-1].value_end = end

    def _string_ended(self, s: str, end: int) -> None:
        if not self._string_is_key:
            self._value_ended(end)
            return
        self._expect = _COLON
        if len(self._open) == 1:
            try:
                self._key = json.loads(s[self._string_start : end])
            except ValueError:
                self.is_failed = True

    def _scalar_ended(self, s: str, end: int) -> None:
        if _SCALAR.fullmatch(s, self._scalar_start, end) is None:
            self.is_failed = True
        else:
            self._value_ended(end)
