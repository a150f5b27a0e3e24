"""``asyncpaged bench overhead``: the engine's own cost per step, on a model whose math is ~free.

A micro Llama (1 layer, hidden 128, 2 heads, vocabulary 2000, float32, seed 0) saved as an HF
directory with the benchmark's word tokenizer; ``--num-seqs`` requests (default 256) of 8-token
prompts each generate ``--max-tokens`` (default 64) tokens, greedy, EOS ignored, every request
read as a DELTA stream by its own task, all submitted at once with ``max_num_seqs`` equal to
their number. The forward of such a model costs well under a millisecond, so the step time is
what the host spends per step: planning, allocation, runner inputs, sampling bookkeeping,
detokenizing and streaming. On an accelerator this is what the device waits for.

Reported per run (``--repeats`` runs, medians): milliseconds per step (the run's wall time
over its steps: one prefill step of 256 x 8 tokens, then decode steps), the share of that time
outside the runner's forward (``1 - compute_time_s / wall``), steps per second, the event-loop
thread's own CPU time per step (``time.thread_time``: the scheduler, intake and allocator
actors, detokenizing and the 256 readers, which all run there) next to the forward's compute
per step, and a digest of every request's tokens (greedy tokens must not change when the
engine changes). ``--sampled``, ``--penalized`` and ``--bad-words`` change the requests'
sampling (the last reads each row's output: with async scheduling its options come late).
``--output DIR`` receives ``overhead.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import anyio

MICRO_MODEL: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 2000,
    "initializer_range": 0.05,
    "max_position_embeddings": 1024,
}


def build_micro_checkpoint(directory: Path) -> Path:
    """The micro model as an HF directory (idempotent: a directory with this config is reused)."""
    from asyncpaged.tools.bench_workload import Workload, build_checkpoint

    workload = Workload(name="overhead", model_config=MICRO_MODEL, prompts=(), max_tokens=())
    return build_checkpoint(workload, directory)


_AHEAD: dict[str, bool | Literal["auto"]] = {"auto": "auto", "on": True, "off": False}


def _prompts(num_seqs: int, vocab: int) -> list[list[int]]:
    return [[4 + (7 * i + 13 * j) % (vocab - 4) for j in range(8)] for i in range(num_seqs)]


async def _one_run(args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    from asyncpaged import AsyncEngine, EngineConfig, RequestOutputKind, SamplingParams

    config = EngineConfig(
        model=str(checkpoint), max_num_seqs=args.num_seqs, max_num_batched_tokens=2048,
        seed=0, enable_prefix_caching=False, executor_backend=args.executor_backend,
        device=args.device, async_scheduling=_AHEAD[args.async_scheduling],
        enforce_eager=args.enforce_eager,
    )  # fmt: skip
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    prompts = _prompts(args.num_seqs, MICRO_MODEL["vocab_size"])
    tokens: list[list[int]] = [[] for _ in prompts]

    def params_of(i: int) -> SamplingParams:
        if args.penalized:  # greedy under vLLM-style penalties: every row reads its history
            return dataclasses.replace(params, repetition_penalty=1.1, frequency_penalty=0.1,
                                       presence_penalty=0.1)  # fmt: skip
        if args.bad_words:  # greedy, each row's banned next tokens follow its output
            return dataclasses.replace(params, bad_words=("w5", "w7 w9", "w11 w13 w15"))
        if not args.sampled:
            return params
        # seeded per request, so the tokens are the same in every run
        return dataclasses.replace(params, temperature=0.8, top_p=0.95, seed=i)

    async with AsyncEngine(config) as engine:
        await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
        before = engine.statistics()

        async def one(i: int) -> None:
            async for delta in engine.generate(prompts[i], params_of(i)):
                tokens[i].extend(delta.outputs[0].token_ids)

        began, loop_cpu = time.perf_counter(), time.thread_time()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        wall = time.perf_counter() - began
        loop_cpu = time.thread_time() - loop_cpu
        after = engine.statistics()
    steps = after.num_steps - before.num_steps
    ahead = after.num_steps_planned_ahead - before.num_steps_planned_ahead
    graphed = after.num_cuda_graph_steps - before.num_cuda_graph_steps
    compute = after.compute_time_s - before.compute_time_s
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    return {"wall_s": wall, "steps": steps,
            "ms_per_step": 1000 * wall / steps, "outside_forward": 1 - compute / wall,
            "steps_per_s": steps / wall, "loop_cpu_ms_per_step": 1000 * loop_cpu / steps,
            "forward_ms_per_step": 1000 * compute / steps, "tokens_digest": digest,
            "executor_backend": engine.config.executor_backend,
            "async_scheduling": engine.config.async_scheduling,
            "steps_planned_ahead": ahead, "cuda_graph_replays": graphed}  # fmt: skip


def cpu_flags() -> str:
    """The CPU's vector flags, as the engine's lever plan reads them (``CpuFeatures``)."""
    from asyncpaged.model.cpu_plan import CpuFeatures

    return " ".join(CpuFeatures.detect().vector_flags())


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    checkpoint = build_micro_checkpoint(Path(args.model_dir).expanduser())
    runs = [anyio.run(_one_run, args, checkpoint) for _ in range(args.repeats)]
    for r in runs:
        print(f"{r['ms_per_step']:6.2f} ms/step over {r['steps']} steps, "
              f"{100 * r['outside_forward']:.0f}% outside the forward, "
              f"{r['steps_per_s']:.1f} steps/s, loop thread CPU "
              f"{r['loop_cpu_ms_per_step']:.2f} ms/step, forward {r['forward_ms_per_step']:.2f} "
              f"ms/step, tokens {r['tokens_digest']}")  # fmt: skip
    median = {key: statistics.median(r[key] for r in runs)
              for key in ("ms_per_step", "outside_forward", "steps_per_s",
                          "loop_cpu_ms_per_step", "forward_ms_per_step")}  # fmt: skip
    same = len({r["tokens_digest"] for r in runs}) == 1
    differ = "" if same else "; TOKENS DIFFER BETWEEN RUNS"
    print(f"median {median['ms_per_step']:.2f} ms/step (goal <= 4 at 256 sequences), "
          f"{100 * median['outside_forward']:.0f}% outside the forward, "
          f"{median['steps_per_s']:.1f} steps/s; CPU flags: {cpu_flags()}; "
          f"{args.threads} torch thread(s), executor {runs[-1]['executor_backend']}, async "
          f"scheduling {'on' if runs[-1]['async_scheduling'] else 'off'} "
          f"({runs[-1]['steps_planned_ahead']} steps planned ahead), CUDA graph replays "
          f"{runs[-1]['cuda_graph_replays']}, device {args.device}{differ}")  # fmt: skip
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(
        {"model": MICRO_MODEL, "num_seqs": args.num_seqs, "max_tokens": args.max_tokens,
         "threads": args.threads, "executor_backend": runs[-1]["executor_backend"],
         "async_scheduling": runs[-1]["async_scheduling"],
         "device": args.device, "enforce_eager": args.enforce_eager,
         "cpu_flags": cpu_flags(), "runs": runs, "median": median},
        indent=2))  # fmt: skip
    return 0 if same else 1


def add_parser(modes: Any) -> None:
    p = modes.add_parser("overhead", help="the engine's host time per step on a micro model")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--executor-backend", choices=("auto", "thread", "process"), default="auto",
                   help="where the model runner runs (EngineConfig.executor_backend)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--async-scheduling", choices=tuple(_AHEAD), default="auto",
                   help="plan a step while the one before runs (async_scheduling)")  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (EngineConfig.enforce_eager)")  # fmt: skip
    workload = p.add_mutually_exclusive_group()
    workload.add_argument(
        "--sampled",
        action="store_true",
        help="temperature 0.8, top_p 0.95, a seed per request (not greedy)",
    )
    workload.add_argument(
        "--penalized",
        action="store_true",
        help="greedy with repetition 1.1, frequency 0.1 and presence 0.1 penalties",
    )
    workload.add_argument(
        "--bad-words",
        action="store_true",
        help="greedy with three bad words (one, two and three tokens long)",
    )
    p.add_argument("--model-dir", default="~/.cache/asyncpaged/bench/overhead")
    p.add_argument("--output", default="bench-results", help="folder for overhead.json")
    p.set_defaults(func=run)
