"""The property every parser meets: for any reply (content, calls with nested JSON, unicode and
markup-like text inside strings) and any split of it into deltas, the stream gives exactly the
non-streamed parse, which finds the reply's content and calls, with no markup in the content."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
)
from tests.tool_parsers.replies import (
    Reply,
    check_reply,
    hermes_replies,
    llama3_json_replies,
    mistral_replies,
    pythonic_replies,
)

cuts = st.lists(st.integers(0, 10**6), max_size=12)
EXAMPLES = settings(max_examples=150, deadline=None)


@EXAMPLES
@given(hermes_replies(), cuts)
def test_hermes_stream_equals_parse(reply: Reply, cuts: list[int]) -> None:
    check_reply(HermesToolParser, reply, cuts)


@EXAMPLES
@given(llama3_json_replies(), cuts)
def test_llama3_json_stream_equals_parse(reply: Reply, cuts: list[int]) -> None:
    check_reply(Llama3JsonToolParser, reply, cuts)


@EXAMPLES
@given(mistral_replies(), cuts)
def test_mistral_stream_equals_parse(reply: Reply, cuts: list[int]) -> None:
    check_reply(MistralToolParser, reply, cuts)


@EXAMPLES
@given(pythonic_replies(), cuts)
def test_pythonic_stream_equals_parse(reply: Reply, cuts: list[int]) -> None:
    check_reply(PythonicToolParser, reply, cuts)
