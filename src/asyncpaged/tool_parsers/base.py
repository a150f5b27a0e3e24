"""The interface of a streaming tool-call parser: :class:`ToolParser` and what it returns,
:class:`ToolParseDelta`.

A parser reads one chat reply as it is generated, one piece of text (a delta) at a time, and
splits it into plain content and tool calls. Deltas may hold a single character, a token or many
tokens at once (jump-forward and speculative decoding emit several tokens per step); a parser
gives the same result for any split of the same reply.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from asyncpaged.outputs import ToolCallDelta
from asyncpaged.tool_choice import CallMarkup
from asyncpaged.tool_parsers.call_ids import random_call_id

__all__ = ["ToolParseDelta", "ToolParser"]


@dataclass(frozen=True, slots=True)
class ToolParseDelta:
    """What a parser makes of the text it was given since its previous answer: ``content`` is
    plain text (the tool-call markup removed) and ``tool_calls`` what is new of the calls (the
    first delta of a call carries its id and name, later ones fragments of its arguments)."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __add__(self, other: ToolParseDelta) -> ToolParseDelta:
        """This delta followed by ``other``."""
        return ToolParseDelta(self.content + other.content, self.tool_calls + other.tool_calls)


class ToolParser(ABC):
    """Reads one chat reply, streamed: :meth:`feed` each new piece of text, then :meth:`finish`
    once the reply has ended (or :meth:`parse` the whole reply at once). A parser instance
    serves one reply.

    ``tools`` are the request's OpenAI tool dicts (``{"type": "function", "function": {"name":
    ..., "parameters": ...}}``); when they name at least one function, the built-in parsers take
    a call to any other name for plain text. ``new_call_id`` makes the id of each call (the
    default: ``"call_"`` and 24 random hex digits).

    Invariants: the content of all answers, concatenated, is the reply's content; the tool-call
    deltas of all answers, assembled by ``calls_from_deltas``, are the reply's calls; text that
    may still turn out to be markup (``<tool_`` at the end of a piece, say) is held back until
    it is decided, and :meth:`finish` releases what never became markup.
    """

    #: How this format writes one call, for the grammar of forced calls (``tool_choice``
    #: ``"required"`` or a named function) and strict tools; None: forced calls are written as
    #: JSON instead (asyncpaged.tool_choice).
    call_markup: ClassVar[CallMarkup | None] = None

    tools: tuple[Mapping[str, Any], ...]
    tool_names: frozenset[str] | None
    new_call_id: Callable[[], str]

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        new_call_id: Callable[[], str] | None = None,
    ) -> None:
        self.tools = tuple(tools or ())
        names = frozenset(_function_names(self.tools))
        self.tool_names = names or None
        self.new_call_id = new_call_id if new_call_id is not None else self.default_call_id

    @staticmethod
    def default_call_id() -> str:
        """The id of a call when no ``new_call_id`` is given."""
        return random_call_id()

    def is_known_tool(self, name: str) -> bool:
        """Whether ``name`` may be called: any name when no tool names a function."""
        return self.tool_names is None or name in self.tool_names

    @abstractmethod
    def feed(self, text: str) -> ToolParseDelta:
        """Read the next piece of the reply; return what it decides."""

    @abstractmethod
    def finish(self) -> ToolParseDelta:
        """The reply has ended: return everything still held back."""

    def parse(self, text: str) -> ToolParseDelta:
        """Read a whole reply at once (the non-streamed parse).

        For a well-formed reply this is ``feed(text) + finish()``. The built-in parsers also know
        here that nothing more follows, so a malformed call becomes content whole, where a stream
        may already have announced it.
        """
        return self.feed(text) + self.finish()


def _function_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    names = []
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names
