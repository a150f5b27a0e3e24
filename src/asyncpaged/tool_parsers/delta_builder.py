"""Collects what a parser decides while it reads a piece of text, and hands it out as one
:class:`ToolParseDelta`."""

from __future__ import annotations

from collections.abc import Callable

from asyncpaged.outputs import ToolCallDelta
from asyncpaged.tool_parsers.base import ToolParseDelta

__all__ = ["DeltaBuilder"]


class DeltaBuilder:
    """Content and tool-call deltas in the order a parser decides them; :meth:`take` returns and
    forgets them. Consecutive argument fragments of one call are merged into one delta.

    Invariant: call indices are handed out 0, 1, 2, ... by :meth:`start_call`, one per call of
    the reply, whatever the number of :meth:`take` calls in between.
    """

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        self._new_call_id = new_call_id
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        """How many calls were started so far."""
        return self._num_calls

    def add_content(self, text: str) -> None:
        """Append plain content."""
        if text:
            self._content.append(text)

    def start_call(self, name: str, arguments: str = "") -> int:
        """Announce a new call (a fresh id, its name, maybe the first fragment of its arguments);
        return its index."""
        index = self._num_calls
        self._num_calls += 1
        self._calls.append(ToolCallDelta(index, self._new_call_id(), name, arguments))
        return index

    def add_arguments(self, index: int, fragment: str) -> None:
        """Append a fragment to the arguments of call ``index``."""
        if not fragment:
            return
        last = self._calls[-1] if self._calls else None
        if last is not None and last.index == index:
            self._calls[-1] = ToolCallDelta(index, last.id, last.name, last.arguments + fragment)
        else:
            self._calls.append(ToolCallDelta(index, arguments=fragment))

    def take(self) -> ToolParseDelta:
        """Everything added since the previous take."""
        delta = ToolParseDelta("".join(self._content), tuple(self._calls))
        self._content.clear()
        self._calls.clear()
        return delta
