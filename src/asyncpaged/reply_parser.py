"""A chat reply split as it streams: the thinking (a reasoning parser), the tool calls (a tool
parser, or the JSON of forced calls) and the content left over.

The engine feeds each sequence's detokenized text to its :class:`ReplyParser` as it grows (any
split: a token, many tokens from jump-forward or speculation) and reads what is new for a
DELTA output or everything for a CUMULATIVE one. The thinking goes first: only the text after
it reaches the tool parser, so a call written while thinking is not a call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncpaged._log import get_logger
from asyncpaged.outputs import ToolCall, ToolCallDelta
from asyncpaged.reasoning import ReasoningParser
from asyncpaged.tool_choice import ForcedCalls
from asyncpaged.tool_parsers import ToolParseDelta, ToolParser, random_call_id

__all__ = ["ReplyParser", "ReplyParsing", "ReplyView"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ReplyParsing:
    """How a chat request's replies are split (one per request, built when it is submitted):
    ``reasoning``, the engine's reasoning parser; ``tool_parser``, the format calls are parsed
    from (``tool_choice`` auto, or forced calls written in the model's markup); ``forced_json``,
    forced calls written as JSON (a format without markup); ``tools``, the request's tools."""

    reasoning: type[ReasoningParser] | None = None
    tool_parser: type[ToolParser] | None = None
    forced_json: ForcedCalls | None = None
    tools: tuple[dict[str, Any], ...] | None = None

    def start(self, *, in_reasoning: bool, streamed: bool = True) -> ReplyParser:
        """A parser for one sequence's reply; ``in_reasoning``: its prompt opened a thinking
        block; ``streamed``: someone reads it before the end (else the calls are parsed from
        the whole answer at the end, where a broken call becomes content whole)."""
        return ReplyParser(self, in_reasoning=in_reasoning, streamed=streamed)


@dataclass(slots=True)
class ReplyView:
    """A reader's view of a reply: content, thinking (None when there is none, or nothing new),
    and the tool calls (whole) or what is new of them (DELTA)."""

    content: str
    reasoning: str | None
    tool_calls: list[ToolCall] | None = None
    tool_call_deltas: list[ToolCallDelta] | None = None


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: str = ""


class ReplyParser:
    """One sequence's reply, split. ``feed`` and ``finish`` are the writer's; ``has_news``,
    ``delta`` and ``whole`` the reader's (``delta`` moves the reader's cursors)."""

    def __init__(self, parsing: ReplyParsing, *, in_reasoning: bool, streamed: bool = True) -> None:
        self._reasoning_parser = (
            None if parsing.reasoning is None else parsing.reasoning(in_reasoning=in_reasoning)
        )
        self._tool_parser = (
            None if parsing.tool_parser is None else parsing.tool_parser(parsing.tools)
        )
        self._forced_json = parsing.forced_json
        self._streamed = streamed
        self._held = ""  # the whole answer, parsed at the end: forced JSON, or not streamed
        self.content = ""
        self.reasoning = ""
        self._deltas: list[ToolCallDelta] = []
        self._calls: list[_Call] = []
        self._read = _Cursors()

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def feed(self, text: str) -> None:
        """The reply's next text."""
        if self._reasoning_parser is None:
            self._answer(text)
            return
        piece = self._reasoning_parser.feed(text)
        self.reasoning += piece.reasoning
        self._answer(piece.content)

    def finish(self) -> None:
        """The reply ended: what the parsers held back is decided."""
        if self._reasoning_parser is not None:
            piece = self._reasoning_parser.finish()
            self.reasoning += piece.reasoning
            self._answer(piece.content)
        parser = self._tool_parser
        if parser is not None:
            if self._streamed:
                self._tool_step(parser.finish, "")
            else:
                held = self._held
                self._tool_step(lambda: parser.parse(held), held)
        elif self._forced_json is not None:
            self._parse_forced(self._held)

    def _answer(self, text: str) -> None:
        if not text:
            return
        parser = self._tool_parser
        if parser is not None and self._streamed:
            self._tool_step(lambda: parser.feed(text), text)
        elif parser is not None or self._forced_json is not None:
            self._held += text
        else:
            self.content += text

    def _tool_step(self, step: Callable[[], ToolParseDelta], text: str) -> None:
        """One call into the tool parser; a parser that raises (one of the host's, say) fails
        no one: from there on the reply is plain text (``text``, what it was given, included;
        what it held back is lost), and a warning says so."""
        try:
            parsed = step()
        except Exception as exc:
            log.warning("tool_parser_failed", parser=type(self._tool_parser).__name__,
                        error=repr(exc))  # fmt: skip
            self._tool_parser = None
            self.content += text
            return
        self.content += parsed.content
        self._add_deltas(parsed.tool_calls)

    def _add_deltas(self, deltas: tuple[ToolCallDelta, ...] | list[ToolCallDelta]) -> None:
        for delta in deltas:
            if delta.index < 0:  # (a parser's mistake: not a call of this reply)
                continue
            self._deltas.append(delta)
            while delta.index >= len(self._calls):
                self._calls.append(_Call(delta.id or random_call_id(), delta.name or ""))
            self._calls[delta.index].arguments += delta.arguments

    def _parse_forced(self, text: str) -> None:
        """Forced calls written as JSON: the arguments of the named function, or a list of
        ``{"name", "parameters"}``; text that is not (a reply cut by ``max_tokens``) stays
        content."""
        forced = self._forced_json
        assert forced is not None
        try:
            value = json.loads(text)
        except ValueError:
            self.content += text
            return
        if forced.name is not None:
            calls = [(forced.name, value)] if isinstance(value, dict) else []
        elif isinstance(value, list):
            calls = [
                (c["name"], c["parameters"])
                for c in value
                if isinstance(c, dict) and isinstance(c.get("name"), str)
                and isinstance(c.get("parameters"), dict)
            ]  # fmt: skip
        else:
            calls = []
        if not calls:
            self.content += text
            return
        start = len(self._calls)
        self._add_deltas(
            [ToolCallDelta(start + i, random_call_id(), name, json.dumps(args, ensure_ascii=False))
             for i, (name, args) in enumerate(calls)]
        )  # fmt: skip

    # ---- the reader ---------------------------------------------------------------------------

    def has_news(self) -> bool:
        read = self._read
        return (
            read.content < len(self.content)
            or read.reasoning < len(self.reasoning)
            or read.deltas < len(self._deltas)
        )

    def delta(self) -> ReplyView:
        """What is new since the last ``delta`` or ``whole``."""
        read = self._read
        view = ReplyView(
            self.content[read.content :],
            self.reasoning[read.reasoning :] or None,
            tool_call_deltas=self._deltas[read.deltas :] or None,
        )
        self._read_all()
        return view

    def whole(self) -> ReplyView:
        """Everything so far."""
        calls = [ToolCall(c.id, c.name, c.arguments) for c in self._calls] or None
        self._read_all()
        return ReplyView(self.content, self.reasoning or None, tool_calls=calls)

    def _read_all(self) -> None:
        read = self._read
        read.content, read.reasoning = len(self.content), len(self.reasoning)
        read.deltas = len(self._deltas)


@dataclass(slots=True)
class _Cursors:
    content: int = 0
    reasoning: int = 0
    deltas: int = field(default=0)
