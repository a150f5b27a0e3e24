"""tools and tool_choice checked before anything is queued, and the grammars of forced calls:
every string a forced grammar accepts is calls whose arguments validate against the tool's
schema (walked with xgrammar's matcher over random accepted paths)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from asyncpaged.errors import InvalidRequestError
from asyncpaged.tool_choice import (
    CallGrammar,
    CallMarkup,
    ForcedCalls,
    check_tool_choice,
    check_tools,
)

xgr = pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
HERMES = CallMarkup(
    "<tool_call>", '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"
)


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("get_weather", "must be a list"),
        ([42], "must be an object"),
        ([{"type": "function", "function": {"description": "x"}}], "name must be"),
        ([{"type": "function", "function": {"name": ""}}], "name must be"),
        ([{"type": "function", "function": {"name": "a b"}}], "at most 64"),
        ([{"type": "function"}], "function must be an object"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "must be 'function'"),
        ([{"function": {"name": "f", "parameters": [1]}}], "JSON schema object"),
        ([{"function": {"name": "f", "parameters": {"type": "string"}}}], "describe an object"),
        ([{"function": {"name": "f", "strict": "yes"}}], "strict must be a bool"),
        ([WEATHER, WEATHER], "two tools are named 'get_weather'"),
    ],
)
def test_malformed_tools_are_refused(tools: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        check_tools(tools)


def test_tools_are_copied_with_their_type() -> None:
    checked = check_tools([{"function": {"name": "f"}}])
    assert checked == ({"type": "function", "function": {"name": "f"}},)


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ("sometimes", "tool_choice must be"),
        ({"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ({"type": "function"}, "tool_choice must be"),
        ({"type": "code", "function": {"name": "add"}}, "tool_choice must be"),
    ],
)
def test_bad_tool_choice_is_refused(choice: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        check_tool_choice(choice, check_tools([WEATHER, ADD]))


def test_forced_choice_needs_tools() -> None:
    with pytest.raises(InvalidRequestError, match="needs tools"):
        check_tool_choice("required", None)
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        check_tool_choice({"type": "function", "function": {"name": "add"}}, None)


def test_tool_choice_forms() -> None:
    tools = check_tools([WEATHER, ADD])
    assert check_tool_choice(None, tools) is None
    assert check_tool_choice("none", tools) == "none"
    assert check_tool_choice("auto", tools) == "auto"
    assert check_tool_choice("required", tools) == ForcedCalls(None)
    named = {"type": "function", "function": {"name": "add"}}
    assert check_tool_choice(named, tools) == ForcedCalls("add")


def test_auto_is_free_without_strict_tools_or_markup() -> None:
    tools = check_tools([WEATHER, ADD])
    assert tools is not None
    assert CallGrammar.of(tools[:1], "auto", HERMES) is None
    assert CallGrammar.of(tools, "auto", None) is None
    assert CallGrammar.of(tools, "auto", HERMES) is not None


def _walk(compiled: Any, rng: random.Random, max_chars: int = 600, prefix: str = "") -> str | None:
    """A random string the grammar accepts after ``prefix``, built character by character
    (None if it does not end within ``max_chars``)."""
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(prefix), prefix
    text = prefix
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "é"]
    for _ in range(max_chars):
        if matcher.is_terminated() or (matcher.is_completed() and rng.random() < 0.7):
            break
        jump = matcher.find_jump_forward_string()
        if jump:
            assert matcher.accept_string(jump)
            text += jump
            continue
        candidates = [ch for ch in rng.sample(alphabet, len(alphabet)) if _try(matcher, ch)]
        if not candidates:
            return text if matcher.is_completed() else None
        closing = [c for c in candidates if c in '"}],<']  # walks that end, mostly
        ch = closing[0] if closing and rng.random() < 0.6 else candidates[0]
        assert matcher.accept_string(ch)
        text += ch
    return text if matcher.is_completed() else None


def _try(matcher: Any, ch: str) -> bool:
    """Whether ``ch`` is allowed next (tried on a fork)."""
    return bool(matcher.fork().accept_string(ch))


def _compile(grammar: CallGrammar, in_reasoning: bool = False) -> Any:
    info = xgr.TokenizerInfo([])
    constraint = grammar.constraint(in_reasoning=in_reasoning)
    assert constraint.structural_tag is not None
    return xgr.GrammarCompiler(info).compile_structural_tag(constraint.structural_tag)


def _valid(name: str, arguments: dict[str, Any]) -> bool:
    if name == "get_weather":
        return (set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str)
                and len(arguments["city"]) <= 12 and arguments["unit"] in ("c", "f"))  # fmt: skip
    return (
        name == "add"
        and set(arguments) == {"a", "b"}
        and all(isinstance(v, int) for v in arguments.values())
    )


def _hermes_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for block in text.split("<tool_call>\n")[1:]:
        body = block.split("\n</tool_call>")[0]
        value = json.loads(body)
        calls.append((value["name"], value["arguments"]))
    return calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_in_markup_always_validate(parallel: bool) -> None:
    tools = check_tools([WEATHER, ADD])
    assert tools is not None
    grammar = CallGrammar(tools, ForcedCalls(None), HERMES, parallel=parallel)
    compiled = _compile(grammar)
    rng = random.Random(0)
    seen = 0
    for _ in range(40):
        text = _walk(compiled, rng)
        if text is None:
            continue
        calls = _hermes_calls(text)
        assert calls, text
        assert parallel or len(calls) == 1
        assert all(_valid(n, a) for n, a in calls), text
        seen += 1
    assert seen >= 20


def test_named_call_in_markup_validates_after_thinking() -> None:
    tools = check_tools([WEATHER, ADD])
    assert tools is not None
    grammar = CallGrammar(tools, ForcedCalls("get_weather"), HERMES,
                          reasoning=("<think>", "</think>"))  # fmt: skip
    rng = random.Random(1)
    for in_reasoning in (False, True):
        compiled = _compile(grammar, in_reasoning)
        seen = 0
        thinking = "a <tool_call> here is no call\n</think>"
        for prefix in ("" if in_reasoning else "<think>") + thinking, "":
            if in_reasoning and not prefix:  # the prompt opened the thinking: it is not skipped
                assert not xgr.GrammarMatcher(compiled).fork().is_completed()
                continue
            text = _walk(compiled, rng, prefix=prefix)
            if text is None:
                continue
            seen += 1
            answer = text.split("</think>")[-1]
            calls = _hermes_calls(answer)
            assert [n for n, _ in calls] == ["get_weather"], text
            assert _valid(*calls[0])
        assert seen >= 1


def test_forced_calls_without_markup_are_json() -> None:
    tools = check_tools([WEATHER, ADD])
    assert tools is not None
    rng = random.Random(2)
    required = _compile(CallGrammar(tools, ForcedCalls(None), None))
    named = _compile(CallGrammar(tools, ForcedCalls("add"), None))
    for _ in range(20):
        text = _walk(required, rng)
        if text is not None:
            calls = json.loads(text)
            assert calls and all(_valid(c["name"], c["parameters"]) for c in calls)
        text = _walk(named, rng)
        if text is not None:
            assert _valid("add", json.loads(text))


def test_strict_auto_constrains_only_calls() -> None:
    tools = check_tools([WEATHER, ADD])
    assert tools is not None
    grammar = CallGrammar.of(tools, "auto", HERMES)
    assert grammar is not None
    compiled = _compile(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string("Let me add: ")  # free text
    assert matcher.accept_string('<tool_call>\n{"name": "add", "arguments": {"a": 1, ')
    assert not matcher.accept_string('"c"')  # the strict schema: a and b only
    assert matcher.accept_string('"b": 2}}\n</tool_call>')
    assert matcher.accept_string(" done")
    # a tool that is not strict takes any object
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('<tool_call>\n{"name": "get_weather", "arguments": {"x": [1]}}')
