"""``asyncpaged serve``: the OpenAI-compatible server (``asyncpaged.server``) under uvicorn.

Starts the engine, mounts nothing else, and serves ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/health``, ``/metrics``, ``/blocks`` and ``/blocks.json`` until
interrupted: Ctrl-C (exit status 130) or SIGTERM (143) let uvicorn drain, then the engine aborts
what is left. Needs the ``serve`` extra: ``pip install 'asyncpaged[serve]'``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

import anyio

from asyncpaged.config import EngineConfig
from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.tools.demo import default_model

BUILTIN_MODEL_NAME = "asyncpaged-default"
_MIB = 1 << 20


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
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
        "executor_backend": args.executor_backend,
    }
    if args.swap_space_mib is not None:
        options["swap_space_bytes"] = int(args.swap_space_mib * _MIB)
    return EngineConfig(**{k: v for k, v in options.items() if v is not None})


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
    async with AsyncEngine(engine_config(args)) as engine:
        app = create_app(engine, served_model_name=name)
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
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--seed", type=int)
    serve.add_argument(
        "--executor-backend", choices=("auto", "thread", "process"), default="auto",
        help="where the model runner runs (EngineConfig.executor_backend; auto: its own "
        "process on a CPU or CUDA device with 2+ cores, so the forward runs while the event loop "
        "serves)",
    )  # fmt: skip
    serve.add_argument("--uvicorn-log-level", default="warning")
    serve.set_defaults(func=lambda a: anyio.run(run_serve, a))
