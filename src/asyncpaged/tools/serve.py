"""``asyncpaged serve``: the OpenAI-compatible server (``asyncpaged.server``) under uvicorn.

Starts the engine, mounts nothing else, and serves ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/health``, ``/metrics``, ``/blocks`` and ``/blocks.json`` until
interrupted: Ctrl-C (exit status 130) or SIGTERM (143) let uvicorn drain, then the engine aborts
what is left. Needs the ``serve`` extra: ``pip install 'asyncpaged[serve]'``.

Flags are vLLM's spellings where the engine has the same setting (``--tensor-parallel-size``,
``--kv-cache-dtype``, ``--chat-template``, ``--enable-prefix-caching``, ``--speculative-config``,
...); :func:`engine_config` and :func:`app_options` turn them into ``EngineConfig`` and
``create_app``'s options, so that a test checks them without starting a server.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, TypedDict

import anyio

from asyncpaged.config import KV_CACHE_DTYPES, EngineConfig
from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.errors import InvalidRequestError
from asyncpaged.spec_decode.config import SpeculativeConfig
from asyncpaged.tools.demo import default_model

BUILTIN_MODEL_NAME = "asyncpaged-default"
_MIB = 1 << 20
API_KEY_ENV = "ASYNCPAGED_API_KEY"
# create_app's limits (asyncpaged.server.limits; repeated here so that parsing imports no
# Starlette: the serve extra is needed only to run)
MAX_REQUEST_BYTES = 32 << 20
MAX_MESSAGES = 2048
MAX_TOOLS = 128
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min",
                     "prompt_lookup_max", "disable_by_batch_size")  # fmt: skip


class AppOptions(TypedDict):
    """``create_app``'s keyword arguments from the command line."""

    api_key: str | None
    protect_metrics: bool
    chat_template: str | None
    max_request_bytes: int
    max_messages: int
    max_tools: int


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options of the command line (unset ones keep EngineConfig's defaults)."""
    options: dict[str, Any] = {
        "model": args.model or default_model(),
        "revision": args.revision,
        "dtype": args.dtype,
        "device": args.device,
        "block_size": args.block_size,
        "num_device_blocks": args.num_device_blocks,
        "kv_cache_bytes": None if args.kv_cache_mib is None else int(args.kv_cache_mib * _MIB),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "preemption_mode": args.preemption_mode,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.enable_prefix_caching,
        "seed": args.seed,
        "executor_backend": args.executor_backend,
        "tensor_parallel_size": args.tensor_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_config": args.speculative_config,
    }
    if args.swap_space_mib is not None:
        options["swap_space_bytes"] = int(args.swap_space_mib * _MIB)
    given = {k: v for k, v in options.items() if v is not None}
    given["tool_call_parser"] = None if args.tool_call_parser == "none" else args.tool_call_parser
    given["reasoning_parser"] = None if args.reasoning_parser == "none" else args.reasoning_parser
    return EngineConfig(**given)


def app_options(args: argparse.Namespace) -> AppOptions:
    """The server options of the command line: the API key (``--api-key``, else the
    environment's ``ASYNCPAGED_API_KEY``), the limits, and ``--chat-template`` read as vLLM
    reads it."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    return AppOptions(api_key=api_key or None, protect_metrics=args.protect_metrics,
                      chat_template=template, max_request_bytes=args.max_request_bytes,
                      max_messages=args.max_messages, max_tools=args.max_tools)  # fmt: skip


def load_chat_template(value: str) -> str:
    """vLLM's ``--chat-template``: the text of the file ``value`` names, else ``value`` itself
    as a Jinja template (its backslash escapes decoded, so that ``\\n`` typed in a shell is a
    newline) when it has one of ``{``, ``}`` or a newline; anything else is taken for a file
    that could not be read (``ValueError``)."""
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it could not be read: {exc}"
            ) from exc
    return codecs.decode(value, "unicode_escape")


def speculative_config(text: str) -> SpeculativeConfig:
    """vLLM's ``--speculative-config`` JSON as ``SpeculativeConfig``: its ``method``
    ("ngram" or "draft_model"; without one, ``"model": "ngram"`` means n-gram lookup and any
    other ``model`` a draft model, as in vLLM), ``num_speculative_tokens``, ``model``,
    ``prompt_lookup_min``/``max`` and ``disable_by_batch_size``. A key the engine has no
    setting for is refused rather than ignored."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("must be a JSON object.")
    unknown = sorted(set(data) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unsupported keys {unknown}; this engine takes {list(_SPECULATIVE_KEYS)}."
        )
    if data.get("method") is None:
        if data.get("model") in ("ngram", "[ngram]"):
            data = {**data, "method": "ngram", "model": None}
        elif data.get("model") is not None:
            data = {**data, "method": "draft_model"}
    try:
        return SpeculativeConfig(**data)
    except (InvalidRequestError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """uvicorn drains on SIGTERM, then re-raises it: end as an exception, so that the engine's
    ``async with`` still aborts what is left and joins its threads (exit status 143)."""
    raise SystemExit(128 + signum)


async def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)

    from asyncpaged.server import create_app

    name = args.served_model_name or args.model or BUILTIN_MODEL_NAME
    options = app_options(args)  # a bad --chat-template fails before the engine starts
    async with AsyncEngine(engine_config(args)) as engine:
        app = create_app(engine, served_model_name=name, **options)
        config = uvicorn.Config(app, host=args.host, port=args.port, lifespan="off",
                                log_level=args.uvicorn_log_level)  # fmt: skip
        server = uvicorn.Server(config)
        sys.stderr.write(
            f"asyncpaged: serving {name!r} on http://{args.host}:{args.port}/v1 "
            f"({engine.num_device_blocks} KV blocks; block map at /blocks)\n"
        )
        await server.serve()
    return 0


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (uvicorn)")
    serve.add_argument("--model", help="a checkpoint directory or hub id (default: built-in)")
    serve.add_argument("--revision", help="hub ids: branch, tag or commit")
    serve.add_argument("--served-model-name",
                       help=f"the `model` clients send (default: --model, or "
                            f"{BUILTIN_MODEL_NAME!r} for the built-in one)")  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", help="auto (default), float32, bfloat16, ...")
    serve.add_argument("--device", help="cpu (default) or cuda")
    serve.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    serve.add_argument("--num-device-blocks", type=int, help="device KV blocks (wins over MiB)")
    serve.add_argument(
        "--kv-cache-mib",
        type=float,
        help="device KV cache size (default: 256 on a CPU; on CUDA see the next)",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="CUDA without a KV size: the share of the device's memory the engine "
        "may use, weights and activations included (default 0.9)",
    )
    serve.add_argument("--swap-space-mib", type=float, help="host swap pool (default 64)")
    serve.add_argument("--preemption-mode", choices=("recompute", "swap"))
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument("--max-num-batched-tokens", type=int)
    serve.add_argument("--max-model-len", type=int, help="default: the model's context length")
    serve.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="reuse the KV blocks of prompts' common prefixes (default: on)",
    )  # fmt: skip
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", default=None,
                       help="the same as --no-enable-prefix-caching")  # fmt: skip
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="ranks the model is split over (default 1; docs/distributed.md)",
    )
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                       help="KV cache dtype (default auto: the model's; int8 / fp8: quantized, "
                            "about 2x the tokens of bfloat16)")  # fmt: skip
    serve.add_argument(
        "--speculative-config", type=speculative_config, metavar="JSON",
        help='speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' or \'{"model": "DRAFT", "num_speculative_tokens": 4}\'',
    )  # fmt: skip
    serve.add_argument("--seed", type=int)
    serve.add_argument(
        "--executor-backend", choices=("auto", "thread", "process"), default="auto",
        help="where the model runner runs (EngineConfig.executor_backend; auto: its own "
        "process on a CPU or CUDA device with 2+ cores, so the forward runs while the event loop "
        "serves)",
    )  # fmt: skip
    serve.add_argument(
        "--tool-call-parser", default="auto",
        help="the format tool calls are parsed from: hermes, llama3_json, mistral, pythonic, "
        "auto (from the chat template, the default) or none",
    )  # fmt: skip
    serve.add_argument(
        "--reasoning-parser", default="auto",
        help="the thinking markers replies are split by: qwen3, deepseek_r1, auto (from the chat "
        "template, the default) or none",
    )  # fmt: skip
    serve.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM's command lines: tool_choice 'auto' works whenever there is a "
        "tool call parser",
    )  # fmt: skip
    serve.add_argument("--chat-template",
                       help="a Jinja file or inline template for chat requests that give none "
                       "(default: the tokenizer's)")  # fmt: skip
    serve.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none)",
    )
    serve.add_argument("--protect-metrics", action="store_true",
                       help="with an API key: /metrics, /blocks and /blocks.json need it too "
                       "(/health stays open)")  # fmt: skip
    serve.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                       help=f"the largest request body; larger is a 413 (default "
                       f"{MAX_REQUEST_BYTES})")  # fmt: skip
    serve.add_argument(
        "--max-messages",
        type=int,
        default=MAX_MESSAGES,
        help=f"the most messages of a chat request (default {MAX_MESSAGES})",
    )
    serve.add_argument("--max-tools", type=int, default=MAX_TOOLS,
                       help=f"the most tools of a chat request (default {MAX_TOOLS})")  # fmt: skip
    serve.add_argument("--uvicorn-log-level", default="warning")
    serve.set_defaults(func=lambda a: anyio.run(run_serve, a))
