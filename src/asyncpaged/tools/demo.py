"""``asyncpaged demo`` and ``asyncpaged generate``: streaming generations in the terminal.

``demo`` starts the engine on the built-in model (or ``--model PATH``) and streams several
concurrent generations side by side, with a live line of engine statistics: running / waiting /
swapped requests, device blocks used / free / shared, preemptions, tokens per second. On a
terminal the panel is redrawn in place; otherwise each finished completion is printed once.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
from typing import Any

import anyio

from asyncpaged.config import EngineConfig
from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.engine.stats import EngineStatistics
from asyncpaged.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = (
    "The return statement",
    "A class definition",
    "The with statement",
    "Exceptions are raised",
    "A generator function",
    "The import system",
)


def default_model() -> str:
    """The built-in trained checkpoint, or a tiny random one if it is not installed."""
    try:
        checkpoint = importlib.import_module("asyncpaged.default_model").path()
        if (checkpoint / "config.json").is_file():
            return str(checkpoint)
    except ImportError:
        pass
    from asyncpaged.testing.tiny_models import build_tiny_checkpoint

    return str(build_tiny_checkpoint("llama-gqa", tempfile.mkdtemp(prefix="asyncpaged-")))


def stats_line(stats: EngineStatistics, tokens: int, elapsed: float) -> str:
    used = stats.num_device_blocks - stats.num_free_device_blocks
    return (
        f"running {stats.num_running}  waiting {stats.num_waiting}  swapped {stats.num_swapped}"
        f" | blocks used {used} free {stats.num_free_device_blocks} shared "
        f"{stats.num_shared_device_blocks} | preemptions {stats.num_preemptions}"
        f" | {tokens / max(elapsed, 1e-9):.1f} tok/s"
    )


class Panel:
    """One line per stream and a statistics line, redrawn in place on a terminal."""

    def __init__(self, labels: list[str], out: Any) -> None:
        self.labels = labels
        self.texts = [""] * len(labels)
        self.done = [False] * len(labels)
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.width = shutil.get_terminal_size((100, 20)).columns
        self._drawn = 0

    def draw(self, status: str) -> None:
        if not self.tty:
            return
        lines = []
        for label, text, done in zip(self.labels, self.texts, self.done, strict=True):
            shown = " ".join(text.split())
            head = f"{'✓' if done else '…'} {label}: "
            room = max(10, self.width - len(head) - 1)
            lines.append(head + (shown[-room:] if len(shown) > room else shown))
        lines.append(status[: self.width - 1])
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F")
        self.out.write("".join(f"\x1b[2K{line}\n" for line in lines))
        self.out.flush()
        self._drawn = len(lines)

    def finish(self, index: int, status: str) -> None:
        self.done[index] = True
        if not self.tty:
            self.out.write(f"[{index}] {self.labels[index]}{self.texts[index]}\n")
            self.out.flush()


async def run_demo(args: argparse.Namespace) -> int:
    model = args.model or default_model()
    config = EngineConfig(model=model, num_device_blocks=args.num_blocks,
                          preemption_mode="swap", seed=args.seed)  # fmt: skip
    params = SamplingParams(temperature=args.temperature, top_p=0.95, seed=args.seed,
                            max_tokens=args.max_tokens,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_streams)]
    panel = Panel(prompts, sys.stdout)
    start = time.perf_counter()
    tokens = 0
    async with AsyncEngine(config) as engine:

        def status() -> str:
            return stats_line(engine.statistics(), tokens, time.perf_counter() - start)

        async def stream(i: int) -> None:
            nonlocal tokens
            async for out in engine.generate(prompts[i], params):
                panel.texts[i] += out.outputs[0].text
                tokens += len(out.outputs[0].token_ids)
                panel.draw(status())
            panel.finish(i, status())

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(stream, i)
        await engine.wait_idle()
        panel.draw(status())
        sys.stdout.write(status() + "\n")
    return 0


async def run_generate(args: argparse.Namespace) -> int:
    model = args.model or default_model()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    async with AsyncEngine(EngineConfig(model=model, seed=args.seed)) as engine:
        sys.stdout.write(args.prompt)
        async for out in engine.generate(args.prompt, params):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def add_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="stream concurrent generations on the built-in model")
    demo.add_argument("--model", help="an HF checkpoint directory (default: the built-in one)")
    demo.add_argument("--num-streams", type=int, default=6)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--temperature", type=float, default=0.8)
    demo.add_argument("--num-blocks", type=int, default=64, help="device KV blocks")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=lambda a: anyio.run(run_demo, a))
    gen = sub.add_parser("generate", help="stream one completion")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="an HF checkpoint directory (default: the built-in one)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=lambda a: anyio.run(run_generate, a))
