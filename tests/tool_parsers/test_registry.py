"""Finding parsers by name, registering one's own, and the parser a chat template implies."""

from __future__ import annotations

import pytest

from asyncpaged.errors import InvalidRequestError
from asyncpaged.tool_parsers import (
    HermesToolParser,
    ToolParseDelta,
    ToolParser,
    get_tool_parser,
    parse_tool_calls,
    register_tool_parser,
    registry,
    tool_parser_for_template,
    tool_parser_names,
)


def test_builtin_parsers_are_registered() -> None:
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(tool_parser_names())
    assert get_tool_parser("hermes") is HermesToolParser


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(InvalidRequestError, match=r"Unknown tool parser 'nope'.*hermes"):
        get_tool_parser("nope")


def test_a_custom_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_PARSERS", dict(registry._PARSERS))  # forget it afterwards

    @register_tool_parser("test_upper")
    class Upper(ToolParser):
        def feed(self, text: str) -> ToolParseDelta:
            return ToolParseDelta(text.upper())

        def finish(self) -> ToolParseDelta:
            return ToolParseDelta()

    assert get_tool_parser("test_upper") is Upper
    assert "test_upper" in tool_parser_names()
    assert parse_tool_calls(Upper(), "abc") == ("ABC", [])


# Excerpts of real chat templates, their long lines cut in two.
QWEN25 = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    '    {{- "\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- endif %}"
)
MISTRAL = (
    "{%- if message.tool_calls is defined %}\n"
    '    {{- "[TOOL_CALLS][" }}\n'
    "    {%- for tool_call in message.tool_calls %}\n"
    '        {{- \'{"name": "\' + tool_call.function.name + \'", "arguments": \' '
    "+ tool_call.function.arguments|tojson + ', \"id\": \"' + tool_call.id + '\"}' }}\n"
    "    {%- endfor %}\n"
    "{%- endif %}"
)
LLAMA31 = (
    "{{- 'Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\\n\\n' }}\n"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}\n"
    "{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
    "{%- endif %}"
)
LLAMA32_PYTHONIC = (
    '{{- "You are an expert in composing functions. [...] you MUST put it in the format of '
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), "
    'func_name2(params)]\\n" }}'
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN25, "hermes"),
        (MISTRAL, "mistral"),
        (LLAMA31, "llama3_json"),
        (LLAMA32_PYTHONIC, "pythonic"),
        ("{{ messages[0]['content'] }}", None),
        (None, None),
        (QWEN25 + MISTRAL, None),
    ],
)
def test_template_detection(template: str | None, expected: str | None) -> None:
    assert tool_parser_for_template(template) == expected
