"""Hypothesis strategies for the tool-parser tests: the truth of a reply (its content and its
calls), rendered in each parser's format, and helpers that feed a text to a parser in pieces."""

from __future__ import annotations

import itertools
import json
import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from asyncpaged.outputs import ToolCall
from asyncpaged.tool_parsers import ToolParser, calls_from_deltas, parse_tool_calls

# Text that looks like the markup of some format, to put inside strings and content.
MARKUP = (
    "<tool_call>", "</tool_call>", "<tool_", "</tool_call", "[TOOL_CALLS]", "[TOOL_", "[ARGS]",
    "[ARGS", "<|python_tag|>", "<|python_", "<|python_start|>", "<|python_end|>", "{", "}",
    "[", "]", "(", ")", '"', "'", "''", '"""', "\\", "\\n", "\\u00e9", ";", ",", ":", "=",
    "\n", " ", "é", "ü", "日本", "🙂", "\u2028", "\x01", "\t",
)  # fmt: skip

markup_text = st.lists(st.one_of(st.sampled_from(MARKUP), st.text(max_size=4)), max_size=6).map(
    "".join
)

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True).filter(
    lambda name: not keyword.iskeyword(name)
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | markup_text,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(markup_text, children, max_size=3)
    ),
    max_leaves=8,
)

arguments = st.dictionaries(identifiers, json_values, max_size=4)
calls = st.lists(st.tuples(identifiers, arguments), max_size=3)


@dataclass(frozen=True)
class Reply:
    """A reply's text and what a parser must make of it (``exact_arguments``: the arguments'
    text exactly, where the format keeps it as written)."""

    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]
    exact_arguments: list[str] | None = None


def content_without(draw: st.DrawFn, *markers: str) -> str:
    text = draw(markup_text)
    assume(not any(marker in text for marker in markers))
    return text


def json_text(draw: st.DrawFn, value: Any) -> str:
    """``value`` as JSON, written in one of the ways models write it."""
    return json.dumps(
        value,
        ensure_ascii=draw(st.booleans()),
        indent=draw(st.sampled_from([None, 2])),
        separators=draw(st.sampled_from([None, (",", ":"), (", ", ": ")])),
    )


def call_object(draw: st.DrawFn, name: str, arguments_text: str, key: str) -> str:
    members = [f'"name": {json.dumps(name)}', f'"{key}": {arguments_text}']
    if draw(st.booleans()):
        members.reverse()
    return "{" + ", ".join(members) + "}"


def separated(draw: st.DrawFn, markers: tuple[str, ...]) -> tuple[str, str]:
    """The text after a call: (text, what of it is content)."""
    if draw(st.booleans()):
        text = draw(st.sampled_from(["", "\n", "\n\n", " ", " \n "]))
        return text, ""
    text = draw(st.sampled_from(["", "\n", " "])) + content_without(draw, *markers)
    return text, text if text.strip(" \t\n\r") else ""


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(
    parser_class: type[ToolParser], pieces: list[str], **kwargs: Any
) -> tuple[str, list[ToolCall]]:
    """Feed ``pieces`` one by one, then finish: (content, calls), checking that only the first
    delta of a call carries its id and name."""
    parser = parser_class(new_call_id=counting_ids(), **kwargs)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    tool_deltas = [d for delta in deltas for d in delta.tool_calls]
    seen: set[int] = set()
    for d in tool_deltas:
        assert (d.id is not None and d.name is not None) == (d.index not in seen), d
        seen.add(d.index)
    assert sorted(seen) == list(range(len(seen)))
    return "".join(delta.content for delta in deltas), calls_from_deltas(tool_deltas)


def parsed(parser_class: type[ToolParser], text: str, **kwargs: Any) -> tuple[str, list[ToolCall]]:
    return parse_tool_calls(parser_class(new_call_id=counting_ids(), **kwargs), text)


def check_reply(parser_class: type[ToolParser], reply: Reply, cuts: list[int]) -> None:
    """The non-streamed parse finds the truth; the stream, cut at ``cuts`` or one character at
    a time, gives the same."""
    content, found = parsed(parser_class, reply.text)
    assert content == reply.content
    assert [(c.name, json.loads(c.arguments)) for c in found] == reply.calls
    if reply.exact_arguments is not None:
        assert [c.arguments for c in found] == reply.exact_arguments
    assert streamed(parser_class, split(reply.text, cuts)) == (content, found)
    assert streamed(parser_class, list(reply.text)) == (content, found)


_LLAMA_SEPARATOR = re.compile(r"[ \t\n\r]*(;[ \t\n\r]*)?")


@st.composite
def hermes_replies(draw: st.DrawFn) -> Reply:
    markers = ("<tool_call>", "</tool_call>")
    truth = draw(calls)
    text = expected = content_without(draw, *markers)
    exact = []
    for name, args in truth:
        args_text = json_text(draw, args)
        exact.append(args_text)
        ws = draw(st.sampled_from(["", "\n", " \n"]))
        obj = call_object(draw, name, args_text, "arguments")
        after, after_content = separated(draw, markers)
        text += f"<tool_call>{ws}{obj}{ws}</tool_call>{after}"
        expected += after_content
    return Reply(text, expected, truth, exact)


@st.composite
def llama3_json_replies(draw: st.DrawFn) -> Reply:
    truth = draw(calls)
    if not truth:
        content = draw(markup_text)
        start = content.lstrip(" \t\n\r").removeprefix("<|python_tag|>").lstrip(" \t\n\r")
        assume(not start.startswith("{"))
        return Reply(content, content, [])
    exact = [json_text(draw, args) for _, args in truth]
    objects = [
        call_object(draw, n, a, "parameters") for (n, _), a in zip(truth, exact, strict=True)
    ]
    prefix = draw(st.sampled_from(["", "<|python_tag|>", " ", "\n<|python_tag|>"]))
    separators = [draw(st.sampled_from(["; ", ";", " ; ", ";\n", "\n"])) for _ in objects]
    text = prefix + "".join(s + o for s, o in zip(["", *separators], objects, strict=False))
    after = draw(st.sampled_from(["", ";", "\n", " ;\n", "\nThat is all.", "; done"]))
    expected = "" if _LLAMA_SEPARATOR.fullmatch(after) else after
    return Reply(text + after, expected, truth, exact)


@st.composite
def mistral_replies(draw: st.DrawFn) -> Reply:
    markers = ("[TOOL_CALLS]",)
    truth: list[tuple[str, dict[str, Any]]] = []
    text = expected = content_without(draw, *markers)
    exact = []
    for _ in range(draw(st.integers(0, 3))):
        block = draw(st.lists(st.tuples(identifiers, arguments), min_size=1, max_size=3))
        texts = [json_text(draw, args) for _, args in block]
        if draw(st.booleans()):  # [TOOL_CALLS]name[ARGS]{...}
            block, texts = block[:1], texts[:1]
            text += f"[TOOL_CALLS]{block[0][0]}[ARGS]{texts[0]}"
        else:  # [TOOL_CALLS][{...}, ...]
            objects = [
                call_object(draw, n, a, "arguments") for (n, _), a in zip(block, texts, strict=True)
            ]
            comma = draw(st.sampled_from([", ", ",", ",\n"]))
            text += (
                "[TOOL_CALLS]" + draw(st.sampled_from(["", " "])) + "[" + comma.join(objects) + "]"
            )
        truth += block
        exact += texts
        after, after_content = separated(draw, markers)
        text += after
        expected += after_content
    return Reply(text, expected, truth, exact)


def python_literal(value: Any) -> str:
    return repr(value)


@st.composite
def pythonic_replies(draw: st.DrawFn) -> Reply:
    truth = draw(calls)
    if not truth:
        content = draw(markup_text)
        start = content.lstrip(" \t\n\r").removeprefix("<|python_start|>").lstrip(" \t\n\r")
        assume(not start.startswith("["))
        return Reply(content, content, [])
    comma = draw(st.sampled_from([", ", ",", ",\n"]))
    rendered = [
        name + "(" + comma.join(f"{k}={python_literal(v)}" for k, v in args.items()) + ")"
        for name, args in truth
    ]
    prefix = draw(st.sampled_from(["", " ", "<|python_start|>", "\n<|python_start|>\n"]))
    after = draw(st.sampled_from(["", "\n", "<|python_end|>", " <|python_end|>\n", "\nDone."]))
    text = prefix + "[" + comma.join(rendered) + draw(st.sampled_from(["", ","])) + "]" + after
    return Reply(text, "\nDone." if after == "\nDone." else "", truth)
