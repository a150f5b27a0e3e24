"""A chat reply split as it streams (``ReplyParser``): thinking, then content and tool calls;
any split of the reply into pieces reads the same as the whole, a call written while thinking
is not a call, a reply read only at the end parses a broken call as content, and forced calls
written as JSON become calls."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncpaged.reasoning import Qwen3ReasoningParser
from asyncpaged.reply_parser import ReplyParser, ReplyParsing
from asyncpaged.tool_choice import ForcedCalls
from asyncpaged.tool_parsers import HermesToolParser, calls_from_deltas

PARSING = ReplyParsing(reasoning=Qwen3ReasoningParser, tool_parser=HermesToolParser)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "</tool_call>"}}\n</tool_call>'
REPLY = f"<think>\nShould I <tool_call> here?\n</think>\n\nSure.\n{CALL}"


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _whole(reply: str, parsing: ReplyParsing = PARSING, streamed: bool = True) -> ReplyParser:
    parser = parsing.start(in_reasoning=False, streamed=streamed)
    parser.feed(reply)
    parser.finish()
    return parser


def test_the_thinking_the_content_and_the_calls() -> None:
    view = _whole(REPLY).whole()
    assert view.reasoning == "\nShould I <tool_call> here?\n"  # not a call: it was thinking
    assert view.content == "\n\nSure.\n"
    assert view.tool_calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in view.tool_calls] == [
        ("add", {"a": 1, "b": "</tool_call>"})
    ]


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_any_split_reads_as_the_whole(cuts: list[int]) -> None:
    whole = _whole(REPLY).whole()
    parser = PARSING.start(in_reasoning=False)
    content, reasoning, deltas = "", "", []
    for piece in _pieces(REPLY, cuts):
        parser.feed(piece)
        if parser.has_news():
            view = parser.delta()
            content += view.content
            reasoning += view.reasoning or ""
            deltas += view.tool_call_deltas or []
    parser.finish()
    view = parser.delta()
    content += view.content
    reasoning += view.reasoning or ""
    deltas += view.tool_call_deltas or []
    assert (content, reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in calls_from_deltas(deltas)] == [
        (c.name, c.arguments) for c in whole.tool_calls or []
    ]
    assert not parser.has_news()


def test_a_reply_read_at_the_end_gives_a_broken_call_as_content() -> None:
    broken = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, </tool_call>'
    parsing = ReplyParsing(tool_parser=HermesToolParser)
    view = _whole(broken, parsing, streamed=False).whole()
    assert (view.content, view.tool_calls, view.reasoning) == (broken, None, None)


def test_forced_calls_written_as_json() -> None:
    required = ReplyParsing(forced_json=ForcedCalls(None))
    view = _whole('[{"name": "add", "parameters": {"a": 1}}, {"name": "f", "parameters": {}}]',
                  required).whole()  # fmt: skip
    assert view.content == "" and view.tool_calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in view.tool_calls] == [
        ("add", {"a": 1}),
        ("f", {}),
    ]
    named = ReplyParsing(forced_json=ForcedCalls("add"))
    view = _whole('{"a": 2}', named).whole()
    assert view.tool_calls is not None and view.tool_calls[0].arguments == '{"a": 2}'
    cut = _whole('{"a": ', named).whole()  # cut short by max_tokens: the text stays
    assert (cut.content, cut.tool_calls) == ('{"a": ', None)


class _Failing(HermesToolParser):
    """A host's parser with a bug: it raises on the second piece it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pieces = 0

    def feed(self, text: str) -> Any:
        self.pieces += 1
        if self.pieces == 2:
            raise RuntimeError("bug")
        return super().feed(text)


def test_a_parser_that_raises_leaves_the_reply_as_text(caplog: pytest.LogCaptureFixture) -> None:
    parser = ReplyParsing(tool_parser=_Failing).start(in_reasoning=False)
    for piece in ("Sure. ", "<tool_call>", "\n{}</tool_call> done"):
        parser.feed(piece)
    parser.finish()
    view = parser.whole()
    assert (view.content, view.tool_calls) == ("Sure. <tool_call>\n{}</tool_call> done", None)
    assert "tool_parser_failed" in caplog.text
