"""``asyncpaged chat``: talk to a checkpoint through its chat template, streaming each reply.

Each line typed is a user message; the reply streams as it is generated and joins the
conversation, so every turn's prompt starts with the previous turns (the prefix cache serves
them). ``/reset`` starts over, ``/exit`` or end of input quits. Sampling follows the model's
``generation_config.json`` unless a flag sets it. Input is read in a worker thread: the engine
keeps running while the prompt waits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import anyio

from asyncpaged.config import EngineConfig
from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.errors import InvalidRequestError
from asyncpaged.sampling_params import RequestOutputKind, SamplingParams
from asyncpaged.tools.demo import default_model

DEFAULT_MAX_TOKENS = 256  # per reply, when neither the flag nor the model sets one


def _params(args: argparse.Namespace, engine: AsyncEngine) -> SamplingParams:
    """Only the flags given: the rest come from the model's generation defaults."""
    given: dict[str, Any] = {
        name: getattr(args, name)
        for name in ("temperature", "top_p", "top_k", "max_tokens", "seed")
        if getattr(args, name) is not None
    }
    if "max_tokens" not in given and "max_tokens" not in engine.generation_defaults.sampling:
        given["max_tokens"] = DEFAULT_MAX_TOKENS
    return SamplingParams(output_kind=RequestOutputKind.DELTA, **given)


async def _reply(
    engine: AsyncEngine, messages: list[dict[str, str]], params: SamplingParams, out: TextIO
) -> str:
    out.write("assistant> ")
    text = []
    async for delta in engine.chat(messages, params):
        piece = delta.outputs[0].text
        text.append(piece)
        out.write(piece)
        out.flush()
    out.write("\n")
    return "".join(text).strip()


async def run_chat(args: argparse.Namespace, stdin: TextIO | None = None,
                   out: TextIO | None = None) -> int:  # fmt: skip
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    config = EngineConfig(model=args.model or default_model(), revision=args.revision,
                          seed=args.seed or 0)  # fmt: skip
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    async with AsyncEngine(config) as engine:
        params = _params(args, engine)
        while True:
            out.write("user> ")
            out.flush()
            line = await anyio.to_thread.run_sync(stdin.readline)
            if not line or line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                messages = list(system)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.strip()})
            try:
                reply = await _reply(engine, messages, params, out)
            except InvalidRequestError as exc:
                out.write(f"\nerror: {exc}\n")
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": reply})
        stats = engine.statistics()
        out.write(f"\n{len(messages) - len(system)} messages; prefix cache hit "
                  f"{stats.prefix_cache_hit_tokens} of {stats.prefix_cache_query_tokens} "
                  "prompt tokens\n")  # fmt: skip
    return 0


def add_parser(sub: Any) -> None:
    chat = sub.add_parser("chat", help="chat with a checkpoint (streaming, multi-turn)")
    chat.add_argument("--model", help="a checkpoint directory or hub id (default: built-in)")
    chat.add_argument("--revision", help="hub ids: branch, tag or commit")
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, help="per reply (default: the model's)")
    chat.add_argument("--temperature", type=float)
    chat.add_argument("--top-p", type=float)
    chat.add_argument("--top-k", type=int)
    chat.add_argument("--seed", type=int)
    chat.set_defaults(func=lambda a: anyio.run(run_chat, a))
