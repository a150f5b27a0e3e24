"""Tool calls through the official ``openai`` client, on a tiny Qwen3-style checkpoint whose
template takes tools: named and ``required`` calls always parse and validate against their
schemas (50 sampled requests each), streamed calls equal non-streamed ones,
``finish_reason == "tool_calls"``; the same with n-gram speculation and jump-forward on; bad
tools and choices are 400s with OpenAI's body."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from starlette.types import ASGIApp

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.server import create_app
from asyncpaged.spec_decode.config import SpeculativeConfig
from asyncpaged.testing.tiny_chat_model import build_tiny_chat_checkpoint
from tests.server.conftest import MODEL_NAME, Live, live_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
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
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module", params=["plain", "ngram-spec"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    path = build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    config = EngineConfig(
        model=str(path), dtype="float32", num_device_blocks=512, seed=0,
        structured_outputs_jump_forward=True,
        speculative_config=spec if request.param == "ngram-spec" else None,
    )  # fmt: skip

    def make(engine: AsyncEngine | None) -> ASGIApp:
        assert engine is not None
        return create_app(engine, served_model_name=MODEL_NAME)

    with live_app(make, config) as server:
        yield server


@pytest.fixture
def client(served: Live) -> Iterator[openai.OpenAI]:
    with served.client() as client:
        yield client


def _eos_bias(live: Live) -> dict[str, int]:
    """The end of turn made likely where the grammar allows it: a random model would chain
    parallel calls up to max_tokens."""
    assert live.engine is not None
    return {str(live.call(lambda: live.engine.tokenizer.eos_token_id)): 4}  # type: ignore[union-attr]


def _check(message: Any, finish: str, names: set[str]) -> list[tuple[str, str]]:
    assert finish == "tool_calls"
    assert message.tool_calls
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls.append((call.function.name, call.function.arguments))
    return calls


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_calls_always_parse_and_validate(
    served: Live, client: openai.OpenAI, choice: str
) -> None:
    tool_choice: Any = (
        {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    )
    bias = _eos_bias(served)

    def one(seed: int) -> list[tuple[str, str]]:
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
            temperature=1.0, seed=seed, max_tokens=400, logit_bias=bias, extra_body=NO_THINKING,
        )  # fmt: skip
        choice_ = reply.choices[0]
        assert choice_.message.content is None
        return _check(choice_.message, choice_.finish_reason, {"add"} if choice == "named"
                      else {"add", "get_weather"})  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(50)))
    assert len(results) == 50 and all(results)
    if choice == "named":
        assert all([name for name, _ in calls] == ["add"] for calls in results)


def test_streamed_calls_equal_non_streamed(served: Live, client: openai.OpenAI) -> None:
    bias = _eos_bias(served)
    for seed in range(6):
        kw: dict[str, Any] = {
            "model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
            "temperature": 1.0, "seed": seed, "max_tokens": 400, "logit_bias": bias,
            "extra_body": NO_THINKING,
        }  # fmt: skip
        whole = client.chat.completions.create(**kw)
        expected = _check(whole.choices[0].message, whole.choices[0].finish_reason,
                          {"add", "get_weather"})  # fmt: skip
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or ():
                    if delta.index not in calls:  # the call's first chunk: id and name
                        assert delta.id and delta.function and delta.function.name
                        calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                    else:
                        assert delta.id is None
                    assert delta.function is not None
                    calls[delta.index]["arguments"] += delta.function.arguments or ""
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name must be"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "JSON schema object"),
        ({"tools": [WEATHER, WEATHER]}, "two tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the tools"),
        ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice must be"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s(client: openai.OpenAI, body: dict[str, Any], message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                       **body)  # fmt: skip
    error = info.value.body
    assert isinstance(error, dict) and message in error["message"], error


def test_a_tool_loop_through_the_server(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "add"}}
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named, temperature=0.0,
        max_tokens=200, extra_body=NO_THINKING,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
        extra_body=NO_THINKING,
    )  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch for ch in text)


def test_reasoning_is_its_own_field_streamed_or_not(client: openai.OpenAI) -> None:
    reply = "<think>\nThe user asks.\n</think>\n\nIt is <b>sunny</b>."
    kw: dict[str, Any] = {
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 64, "temperature": 0.0,
        "extra_body": {"structured_outputs": {"regex": _regex(reply)}},
    }  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    extra = whole.message.model_extra or {}
    assert extra["reasoning"] == extra["reasoning_content"] == "\nThe user asks.\n"
    assert whole.message.content == "\n\nIt is <b>sunny</b>."
    content, reasoning = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            delta_extra = choice.delta.model_extra or {}
            reasoning += delta_extra.get("reasoning") or ""
    assert (content, reasoning) == (whole.message.content, extra["reasoning"])
