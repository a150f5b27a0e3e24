"""A multi-turn tool loop through ``engine.chat``: the model calls a tool, the host runs it, the
result goes back as a ``tool`` message, and the model answers.

    python examples/tool_loop.py                          # a tiny random Qwen3-style model
    python examples/tool_loop.py --model Qwen/Qwen3-0.6B --tool-choice auto

The tiny model writes nonsense, so by default the call is forced (``tool_choice="required"``,
one call per turn): the grammar makes it a well-formed ``<tool_call>`` whose arguments match the
tool's schema. A real model chooses for itself under ``"auto"``. The first turn is streamed:
the call's name arrives once, its arguments as fragments.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import anyio

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.outputs import ToolCall
from asyncpaged.sampling_params import RequestOutputKind

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]


def get_weather(city: str, unit: str) -> dict[str, Any]:
    """The host's implementation of the tool."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "sky": "clear"}


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from asyncpaged.testing.tiny_chat_model import build_tiny_chat_checkpoint

            model = str(build_tiny_chat_checkpoint(tmp))
        config = EngineConfig(model=model, num_device_blocks=128, seed=0)
        async with AsyncEngine(config) as engine:
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": "What is the weather in Paris, in celsius?"}
            ]
            params = SamplingParams(temperature=0.7, seed=args.seed, max_tokens=args.max_tokens,
                                    output_kind=RequestOutputKind.DELTA)  # fmt: skip
            # Turn 1, streamed: the call arrives as deltas (name once, then argument fragments).
            calls: dict[int, dict[str, str]] = {}
            finish = None
            stream = engine.chat(messages, params, tools=TOOLS, tool_choice=args.tool_choice,
                                 parallel_tool_calls=False)  # fmt: skip
            async for out in stream:
                completion = out.outputs[0]
                for delta in completion.tool_call_deltas or ():
                    call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = delta.id or call["id"]
                    call["name"] = delta.name or call["name"]
                    call["arguments"] += delta.arguments
                finish = completion.finish_reason or finish
            print(f"turn 1 finished: {finish}, {len(calls)} call(s)")
            if finish != "tool_calls":
                raise SystemExit("the model answered without a (complete) call")
            tool_calls = [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls.values()]
            messages.append({
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in tool_calls
                ],
            })  # fmt: skip
            for call in tool_calls:
                result = get_weather(**json.loads(call.arguments))
                print(f"called {call.name}({call.arguments}) -> {result}")
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
                )
            # Turn 2: the model answers with the tool's result in its prompt.
            final = await engine.chat(
                messages, SamplingParams(temperature=0.7, seed=args.seed, max_tokens=24),
                tools=TOOLS, tool_choice="none",
            )  # fmt: skip
            print(f"answer: {final.outputs[0].text!r}")
            print("tool loop done")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a chat checkpoint with tool calls (default: a tiny one)")
    parser.add_argument("--tool-choice", default="required", help="none, auto or required")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0)
    anyio.run(main, parser.parse_args())
