"""One Python function call (``get_weather(city="Paris", days=3)``) read as it streams: where
it ends, and its keyword arguments as a JSON object once it is complete."""

from __future__ import annotations

import ast
import json
import re

__all__ = ["PythonCallScanner", "python_call_to_json"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PythonCallScanner:
    """Reads ``name(...)`` in pieces (:meth:`consume`), tracking brackets and string literals
    (single, double and triple quotes, with backslash escapes), up to the ``)`` that closes
    the call.

    Invariants: ``text`` is everything consumed and ends with that ``)`` once ``is_complete``;
    once ``is_failed`` or ``is_complete``, nothing more is consumed. A quote that may open a
    triple-quoted string is consumed only when the next two characters are known.
    """

    def __init__(self) -> None:
        self.text = ""
        self.is_complete = False
        self.is_failed = False
        self._depth = 0  # open brackets; 0 while reading the name
        self._quote = ""  # the quote of the string being read ('', "'", '"', "'''", '"""')
        self._escape = False

    def consume(self, text: str) -> int:
        """Read ``text`` up to the call's ``)``, the first character that cannot belong to the
        call, or a quote that needs more text; return how many characters were read."""
        base = len(self.text)
        s = self.text + text
        i = base
        n = len(s)
        if self._depth == 0:
            i = self._read_name(s, i)
        while self._depth > 0 and i < n and not self.is_complete:
            c = s[i]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == self._quote[0] and len(self._quote) == 3 and n - i < 3:
                    break  # maybe the closing triple quote, cut
                elif s.startswith(self._quote, i):
                    i += len(self._quote) - 1
                    self._quote = ""
                i += 1
            elif c in "'\"":
                if n - i < 3:  # '' or ''' cannot be told apart yet
                    break
                self._quote = c * 3 if s.startswith(c * 3, i) else c
                i += len(self._quote)
            else:
                if c in "([{":
                    self._depth += 1
                elif c in ")]}":
                    self._depth -= 1
                    self.is_complete = self._depth == 0
                i += 1
        self.text = s[:i]
        return i - base

    def _read_name(self, s: str, i: int) -> int:
        """Read the callee's name and its "("; return where reading stopped."""
        name = _NAME.match(s)
        end = name.end() if name else 0
        if end < len(s):
            if end == 0 or s[end] != "(":
                self.is_failed = True
                return max(end, i)
            self._depth = 1
            return end + 1
        return len(s)


def python_call_to_json(text: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON object) of a call with keyword arguments whose values are
    literals (str, int, float, bool, None, and lists, tuples and dicts of them); None for
    anything else."""
    try:
        call = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        return None
    arguments: dict[str, object] = {}
    for keyword in call.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    try:
        return call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
