"""Replies as real models write them, malformed calls, and what each format does around calls."""

from __future__ import annotations

import json

import pytest

from asyncpaged.outputs import ToolCall
from asyncpaged.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
    get_tool_parser,
    mistral_call_id,
    random_call_id,
)
from tests.tool_parsers.replies import parsed, streamed

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def both(parser_class: type[ToolParser], text: str, **kwargs: object) -> tuple[str, list[ToolCall]]:
    """The non-streamed parse, checked equal to the stream fed one character at a time."""
    result = parsed(parser_class, text, **kwargs)
    assert streamed(parser_class, list(text), **kwargs) == result
    return result


def named(calls: list[ToolCall]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_qwen25_hermes_reply() -> None:
    text = (
        "I'll check both cities.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "celsius"}}'
        "\n</tool_call>\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"location": "Tokyo", "unit": "celsius"}}'
        "\n</tool_call>"
    )
    content, calls = both(HermesToolParser, text)
    assert content == "I'll check both cities.\n"
    assert calls == [
        ToolCall("call_0", "get_weather", '{"location": "San Francisco, CA", "unit": "celsius"}'),
        ToolCall("call_1", "get_weather", '{"location": "Tokyo", "unit": "celsius"}'),
    ]


def test_hermes_arguments_stream_as_they_are_generated() -> None:
    parser = HermesToolParser(new_call_id=lambda: "id")
    assert parser.feed('<tool_call>\n{"name": "f", "argu').tool_calls == ()
    first = parser.feed('ments": {"code": "if (a) {')
    assert [(d.id, d.name, d.arguments) for d in first.tool_calls] == [
        ("id", "f", '{"code": "if (a) {')
    ]
    assert parser.feed('}"}').tool_calls[0].arguments == '}"}'
    assert parser.feed("}\n</tool_call>") == parser.finish()  # nothing new: both empty


def test_hermes_text_after_calls() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.'
    assert both(HermesToolParser, text)[0] == "\n\nDone."
    assert both(HermesToolParser, text.replace("Done.", " \n"))[0] == ""


def test_hermes_held_partial_marker_is_released_at_the_end() -> None:
    parser = HermesToolParser()
    assert parser.feed("a <tool_").content == "a "
    assert parser.finish().content == "<tool_"


def test_hermes_complete_call_without_closing_tag() -> None:
    content, calls = both(HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert (content, named(calls)) == ("", [("f", {"a": 1})])


def test_hermes_text_after_the_object_inside_the_markup_is_dropped() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing\n</tool_call>'
    assert named(both(HermesToolParser, text)[1]) == [("f", {"a": 1})]
    assert both(HermesToolParser, text)[0] == ""


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # missing }
        '<tool_call>\n{"name": "f"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": {"a": ',  # cut short
    ],
)
def test_hermes_malformed_call_is_content(bad: str) -> None:
    text = f'Hi {bad} <tool_call>{{"name": "g", "arguments": {{}}}}</tool_call>'
    content, calls = parsed(HermesToolParser, text)
    if bad.endswith(": "):  # the cut call swallows the rest of the reply
        assert (content, calls) == (text, [])
    else:
        assert content == f"Hi {bad} "
        assert named(calls) == [("g", {})]
        assert streamed(HermesToolParser, list(text))[1][-1].name == "g"


def test_a_stream_keeps_an_announced_call_that_breaks() -> None:
    parser = HermesToolParser(new_call_id=lambda: "id")
    first = parser.feed('<tool_call>{"name": "f", "arguments": {"a": 1')
    assert first.tool_calls[0].name == "f"
    rest = parser.feed("]}</tool_call>") + parser.finish()
    assert rest.content == "]}</tool_call>"  # what was not streamed as arguments
    assert rest.tool_calls == ()


def test_unknown_tool_names_are_content_when_tools_are_given() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert both(HermesToolParser, text, tools=WEATHER) == (text, [])
    assert named(both(HermesToolParser, text)[1]) == [("get_time", {})]
    good = text.replace("get_time", "get_weather")
    assert named(both(HermesToolParser, good, tools=WEATHER)[1]) == [("get_weather", {})]


def test_llama31_json_with_python_tag() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}'
    )
    content, calls = both(Llama3JsonToolParser, text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"zone": "CET"}'),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",
        '{"name": "John", "age": 30}',  # a JSON answer, no call
        "<|python_tag|>print(1)",
    ],
)
def test_llama3_json_content(text: str) -> None:
    assert both(Llama3JsonToolParser, text) == (text, [])


def test_llama3_json_unterminated_call() -> None:
    text = ' {"name": "f", "parameters": {"a": 1}'
    assert parsed(Llama3JsonToolParser, text) == (text, [])
    content, calls = streamed(Llama3JsonToolParser, [text])  # announced while it streamed
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("f", '{"a": 1}')])


def test_mistral_list_form() -> None:
    text = (
        'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    )
    content, calls = both(MistralToolParser, text)
    assert content == "Let me check."
    assert named(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_mistral_args_form() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    content, calls = both(MistralToolParser, text)
    assert (content, named(calls)) == ("", [("get_weather", {"city": "Paris"}), ("get_time", {})])


def test_mistral_default_ids_are_nine_alphanumerics() -> None:
    delta = MistralToolParser().parse("[TOOL_CALLS]f[ARGS]{}")
    call_id = delta.tool_calls[0].id
    assert call_id is not None and len(call_id) == 9 and call_id.isalnum()
    assert len(mistral_call_id()) == 9
    assert random_call_id().startswith("call_") and len(random_call_id()) == 29
    hermes_id = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert (hermes_id.tool_calls[0].id or "").startswith("call_")


@pytest.mark.parametrize(
    "text",
    ["[TOOL_CALLS]", "[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]f[ARGS]{", "[TOOL_CALLS][]"],
)
def test_mistral_malformed_is_content(text: str) -> None:
    assert parsed(MistralToolParser, text) == (text, [])


def test_llama32_pythonic_list() -> None:
    text = '[get_weather(city="San Francisco", metric=True), get_time(zone=None, when=[1, 2.5])]'
    content, calls = both(PythonicToolParser, text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "San Francisco", "metric": true}'),
        ("get_time", '{"zone": null, "when": [1, 2.5]}'),
    ]


def test_llama4_pythonic_with_tags() -> None:
    text = "<|python_start|>[get_weather(city='Paris (France)')]<|python_end|>"
    assert named(both(PythonicToolParser, text)[1]) == [("get_weather", {"city": "Paris (France)"})]


def test_pythonic_calls_stream_one_by_one() -> None:
    parser = PythonicToolParser()
    assert parser.feed("[f(a=1), g(b=").tool_calls[0].name == "f"
    assert parser.feed("'''x)''')]").tool_calls[0].arguments == '{"b": "x)"}'


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2, 3] are numbers",
        "[f(1)]",  # positional argument
        "[f(a=x)]",  # not a literal
        "[f(a={1, 2})]",  # a set is not JSON
        "[f(a=1), g(b=2)",  # unterminated
        "[f(a=1) g(b=2)]",
        "[]",
    ],
)
def test_pythonic_malformed_is_content(text: str) -> None:
    assert parsed(PythonicToolParser, text) == (text, [])


def test_pythonic_stream_keeps_the_calls_before_a_malformed_one() -> None:
    content, calls = streamed(PythonicToolParser, ["[f(a=1), ", "g(1)]"])
    assert (content, named(calls)) == (", g(1)]", [("f", {"a": 1})])


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_plain_text_is_content(name: str) -> None:
    text = "Paris is the capital of France. {not a call} [neither]"
    assert both(get_tool_parser(name), text) == (text, [])
