"""Tool calls through ``engine.chat`` on a tiny Qwen3-style checkpoint (hermes markup, <think>).

Forced calls (``tool_choice`` "required" or named) always parse and validate against the tool's
schema, sampled at temperature 1 from a random model; streamed calls equal non-streamed ones;
``auto`` parses what the model writes (driven here by a regex constraint that makes the random
model write a given reply, jump-forward splitting it into multi-token pieces); a broken call is
content; bad tools and choices are refused before anything is queued.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest

from asyncpaged import InvalidRequestError, SamplingParams, StructuredOutputsParams
from asyncpaged.outputs import RequestOutput
from asyncpaged.sampling_params import RequestOutputKind
from asyncpaged.spec_decode.config import SpeculativeConfig
from asyncpaged.testing.tiny_chat_model import build_tiny_chat_checkpoint
from asyncpaged.tool_parsers import calls_from_deltas
from tests.engine.conftest import assert_no_leaks, running_engine

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
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
                "b": {"enum": [1, 2, 3]},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))


def _valid_calls(out: RequestOutput, names: set[str]) -> list[tuple[str, dict[str, Any]]]:
    completion = out.outputs[0]
    assert completion.finish_reason == "tool_calls", (completion.text, completion.finish_reason)
    assert completion.tool_calls, completion.text
    calls = []
    for call in completion.tool_calls:
        assert call.name in names
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.name])
        calls.append((call.name, arguments))
    return calls


async def _sampled(engine: Any, tool_choice: Any, seeds: range, **kw: Any) -> list[RequestOutput]:
    """Replies sampled at temperature 1; the end of turn is made likely where the grammar
    allows it (a random model would otherwise chain parallel calls to ``max_tokens``)."""
    outs: list[RequestOutput] = []
    eos = engine.tokenizer.eos_token_id

    async def one(seed: int) -> None:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                                logit_bias={eos: 4.0})  # fmt: skip
        outs.append(await engine.chat(MESSAGES, params, tools=TOOLS, tool_choice=tool_choice,
                                      chat_template_kwargs=NO_THINKING, **kw))  # fmt: skip

    async with anyio.create_task_group() as tg:
        for seed in seeds:
            tg.start_soon(one, seed)
    return outs


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram-spec"])
async def test_forced_calls_always_parse_and_validate(chat_model: Path, speculative: bool) -> None:
    spec = {"speculative_config": SpeculativeConfig(method="ngram", num_speculative_tokens=3)}
    config: dict[str, Any] = {"num_device_blocks": 256, **(spec if speculative else {})}
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with running_engine(chat_model, **config) as engine:
        assert engine.tool_parser is not None and engine.tool_parser.__name__ == "HermesToolParser"
        for out in await _sampled(engine, named, range(12)):
            calls = _valid_calls(out, {"get_weather"})
            assert len(calls) == 1 and out.outputs[0].text == ""
        add = {"type": "function", "function": {"name": "add"}}
        for out in await _sampled(engine, add, range(4)):
            assert [name for name, _ in _valid_calls(out, {"add"})] == ["add"]
        for out in await _sampled(engine, "required", range(12)):
            _valid_calls(out, {"get_weather", "add"})
        for out in await _sampled(engine, "required", range(6), parallel_tool_calls=False):
            assert len(_valid_calls(out, {"get_weather", "add"})) == 1


async def test_streamed_calls_equal_the_whole_ones(chat_model: Path) -> None:
    async with running_engine(chat_model, num_device_blocks=256) as engine:
        for seed in range(4):
            kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required",
                                  "chat_template_kwargs": NO_THINKING}  # fmt: skip
            whole = await engine.chat(
                MESSAGES, SamplingParams(temperature=1.0, seed=seed, max_tokens=160), **kw
            )
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                    output_kind=RequestOutputKind.DELTA)  # fmt: skip
            deltas, text, finish = [], "", None
            async for out in engine.chat(MESSAGES, params, **kw):
                completion = out.outputs[0]
                assert completion.tool_calls is None
                deltas.extend(completion.tool_call_deltas or ())
                text += completion.text
                finish = completion.finish_reason or finish
            streamed = [(c.name, c.arguments) for c in calls_from_deltas(deltas)]
            expected = [(c.name, c.arguments) for c in whole.outputs[0].tool_calls or ()]
            assert streamed == expected and streamed
            assert (text, finish) == (whole.outputs[0].text, whole.outputs[0].finish_reason)
            # the id comes once, with the name, and is the call's id in the merged output
            assert [d.id is not None for d in deltas] == [d.name is not None for d in deltas]


def _scripted(reply: str, **kw: Any) -> SamplingParams:
    """Parameters that make the random model write ``reply`` (a regex of it, which
    jump-forward turns into multi-token steps)."""
    literal = "".join("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch for ch in reply)
    return SamplingParams(temperature=0.0, max_tokens=200,
                          structured_outputs=StructuredOutputsParams(regex=literal),
                          **kw)  # fmt: skip


CALL_REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
    '{"a": 1, "b": 2}}\n</tool_call>'
)


@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda k: k.name)
async def test_auto_parses_the_calls_a_model_writes(
    chat_model: Path, kind: RequestOutputKind
) -> None:
    async with running_engine(chat_model, num_device_blocks=256) as engine:
        stream = engine.chat(MESSAGES, _scripted(CALL_REPLY, output_kind=kind), tools=TOOLS,
                             chat_template_kwargs=NO_THINKING)  # fmt: skip
        merged: RequestOutput | None = None
        async for out in stream:
            if merged is None:
                merged = out
            else:
                merged.add(out, aggregate=kind is RequestOutputKind.DELTA)
        assert merged is not None
        completion = merged.outputs[0]
        assert completion.finish_reason == "tool_calls"
        assert completion.text == "Let me check.\n"  # hermes: the text before the first call
        if kind is RequestOutputKind.DELTA:
            calls = calls_from_deltas(completion.tool_call_deltas or [])
        else:
            calls = completion.tool_calls or []
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("add", {"a": 1, "b": 2}),
        ]


async def test_a_broken_call_is_content(chat_model: Path) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> ok'
    async with running_engine(chat_model, num_device_blocks=256) as engine:
        out = await engine.chat(MESSAGES, _scripted(broken), tools=TOOLS,
                                chat_template_kwargs=NO_THINKING)  # fmt: skip
        completion = out.outputs[0]
        assert (completion.text, completion.tool_calls) == (broken, None)
        assert completion.finish_reason == "stop"
        params = _scripted(broken, output_kind=RequestOutputKind.DELTA)
        async for _ in engine.chat(MESSAGES, params, tools=TOOLS, chat_template_kwargs=NO_THINKING):
            pass  # streamed: whatever was announced stays, and nothing raises


async def test_tool_choice_none_and_no_tools_leave_the_text(chat_model: Path) -> None:
    async with running_engine(chat_model, num_device_blocks=256) as engine:
        for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
            out = await engine.chat(MESSAGES, _scripted(CALL_REPLY),
                                    chat_template_kwargs=NO_THINKING, **kw)  # fmt: skip
            assert (out.outputs[0].text, out.outputs[0].tool_calls) == (CALL_REPLY, None)
            assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "name must be"),
        ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "JSON schema object"),
        ({"tools": [WEATHER, WEATHER]}, "two tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_call_parser": "nope"}, "nope"),
    ],
)
async def test_bad_tools_are_refused_before_queueing(
    chat_model: Path, kw: dict[str, Any], message: str
) -> None:
    async with running_engine(chat_model, num_device_blocks=64) as engine:
        with pytest.raises(InvalidRequestError, match=message):
            engine.chat(MESSAGES, SamplingParams(max_tokens=4), **kw)
        assert_no_leaks(engine)  # nothing was registered or queued
        forced = {"tools": TOOLS, "tool_choice": "required"}
        with pytest.raises(InvalidRequestError, match="one grammar per request"):
            engine.chat(MESSAGES, _scripted("x"), **forced)


async def test_auto_needs_a_parser(chat_model: Path) -> None:
    async with running_engine(chat_model, num_device_blocks=128, tool_call_parser=None) as engine:
        assert engine.tool_parser is None
        with pytest.raises(InvalidRequestError, match="needs a tool call parser"):
            engine.chat(MESSAGES, SamplingParams(max_tokens=4), tools=TOOLS, tool_choice="auto")
        # not given: the tools reach the template, the reply is left as it is
        out = await engine.chat(MESSAGES, _scripted(CALL_REPLY), tools=TOOLS,
                                chat_template_kwargs=NO_THINKING)  # fmt: skip
        assert out.outputs[0].tool_calls is None and out.outputs[0].text == CALL_REPLY
        # forced calls without a parser are written as JSON and parsed from it
        out = await engine.chat(MESSAGES, SamplingParams(temperature=1.0, seed=3, max_tokens=160),
                                tools=TOOLS, tool_choice="required",
                                chat_template_kwargs=NO_THINKING)  # fmt: skip
        _valid_calls(out, {"get_weather", "add"})


async def test_strict_tools_under_auto_constrain_a_call_once_it_starts(chat_model: Path) -> None:
    strict_add = {**ADD, "function": {**ADD["function"], "strict": True}}
    async with running_engine(chat_model, num_device_blocks=256) as engine:
        start = engine.tokenizer.convert_tokens_to_ids("<tool_call>")
        eos = engine.tokenizer.eos_token_id
        for seed in range(6):
            # the random model is pushed to open a call (and to end the turn where it may);
            # from "<tool_call>" on the grammar writes a strict tool's call by its schema
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                                    logit_bias={start: 8.0, eos: 4.0})  # fmt: skip
            out = await engine.chat(MESSAGES, params, tools=[strict_add], tool_choice="auto",
                                    parallel_tool_calls=False,
                                    chat_template_kwargs=NO_THINKING)  # fmt: skip
            assert [name for name, _ in _valid_calls(out, {"add"})] == ["add"]


def test_llm_chat_takes_tools(chat_model: Path) -> None:
    from asyncpaged import LLM

    named = {"type": "function", "function": {"name": "get_weather"}}
    with LLM(chat_model, num_device_blocks=128, dtype="float32") as llm:
        (out,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=160),
                          tools=TOOLS, tool_choice=named, chat_template_kwargs=NO_THINKING,
                          use_tqdm=False)  # fmt: skip
    assert [name for name, _ in _valid_calls(out, {"get_weather"})] == ["get_weather"]
