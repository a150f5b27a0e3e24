"""Broken output never raises: random text and damaged replies (cut short, a slice deleted,
junk inserted) give content, in both modes; without a call, the non-streamed content is the
text itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
)
from tests.tool_parsers.replies import (
    MARKUP,
    hermes_replies,
    llama3_json_replies,
    markup_text,
    mistral_replies,
    parsed,
    pythonic_replies,
    split,
    streamed,
)

FORMATS = [
    (HermesToolParser, hermes_replies()),
    (Llama3JsonToolParser, llama3_json_replies()),
    (MistralToolParser, mistral_replies()),
    (PythonicToolParser, pythonic_replies()),
]


@st.composite
def damaged(draw: st.DrawFn, replies: st.SearchStrategy) -> str:
    text = draw(replies).text
    a, b = sorted(draw(st.lists(st.integers(0, len(text)), min_size=2, max_size=2)))
    how = draw(st.sampled_from(["cut", "delete", "insert"]))
    if how == "cut":
        return text[:a]
    if how == "delete":
        return text[:a] + text[b:]
    return text[:a] + draw(st.sampled_from(MARKUP)) + text[a:]


def check_never_raises(parser_class: type[ToolParser], text: str, cuts: list[int]) -> None:
    content, calls = parsed(parser_class, text)
    if not calls:
        assert content == text
    stream_content, stream_calls = streamed(parser_class, split(text, cuts))
    if not stream_calls:
        assert stream_content == text


@pytest.mark.parametrize(
    ("parser_class", "replies"), FORMATS, ids=lambda x: getattr(x, "__name__", "")
)
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_damaged_replies_never_raise(
    parser_class: type[ToolParser], replies: st.SearchStrategy, data: st.DataObject
) -> None:
    text = data.draw(st.one_of(damaged(replies), markup_text))
    check_never_raises(parser_class, text, data.draw(st.lists(st.integers(0, 10**6), max_size=8)))
