"""``asyncpaged bench multiturn``: many chat users, a few turns each, on a device KV pool smaller
than their working set; TTFT and throughput with the KV tiers off, host, and host + disk.

Each of ``--users`` users starts with a shared system prompt and a user-specific context, then
takes ``--turns`` turns: its prompt is the whole conversation so far (every earlier message and
answer) plus a new message, and the answer (greedy, ``--max-tokens``) joins the history. At most
``--concurrency`` requests run at once, users taking turns round-robin, so between two turns of
one user the others' work evicts its blocks from the device pool (``--device-blocks``). Without
tiers the next turn recomputes the evicted history; with the host tier it is copied back; with
host + disk a small host tier spills to files in a temporary directory. Tokens are checked
identical across modes (greedy, the tiers only move K/V). A warm-up pass over every mode is
discarded (shapes seen first pay oneDNN's primitive builds), then ``--repeats`` interleaved
runs of each mode give medians. ``--output DIR`` receives
``multiturn.json`` and ``multiturn.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from tqdm import tqdm  # type: ignore[import-untyped]

from asyncpaged.tools.proc_stats import engine_cpu_s

MODES = ("off", "host", "host+disk")
SUMMARY_KEYS = ("tok_per_s", "tok_per_cpu_s", "ttft_median_s", "ttft_p90_s", "ttft_mean_s",
                "wall_s", "cpu_s", "step_time_s", "compute_time_s")  # fmt: skip


def _tier_config(mode: str, block_bytes: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    if mode == "off":
        return {}
    if mode == "host":
        return {"kv_offload_host_bytes": args.host_blocks * block_bytes}
    return {
        "kv_offload_host_bytes": args.small_host_blocks * block_bytes,
        "kv_offload_dir": tmp,
        "kv_offload_disk_bytes": 4 * args.host_blocks * (block_bytes + 256),
    }


async def _one_run(args: argparse.Namespace, mode: str, block_bytes: int) -> dict[str, Any]:
    from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
    from asyncpaged.tools.demo import default_model

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="asyncpaged-kv-") as tmp:
        config = EngineConfig(
            model=default_model(), seed=args.seed, num_device_blocks=args.device_blocks,
            max_num_seqs=args.concurrency, executor_backend=args.executor_backend,
            **_tier_config(mode, block_bytes, args, tmp),
        )  # fmt: skip
        async with AsyncEngine(config) as engine:
            vocab = engine.vocab_size
            system = [rng.randrange(4, vocab) for _ in range(args.system_tokens)]
            history = [
                system + [rng.randrange(4, vocab) for _ in range(args.context_tokens)]
                for _ in range(args.users)
            ]
            messages = [
                [[rng.randrange(4, vocab) for _ in range(args.message_tokens)]
                 for _ in range(args.turns)]
                for _ in range(args.users)
            ]  # fmt: skip
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            limiter = anyio.Semaphore(args.concurrency)
            ttft: list[float] = []
            answers: dict[tuple[int, int], list[int]] = {}
            bar = tqdm(total=args.users * args.turns, desc=mode, leave=False,
                       disable=not args.progress)  # fmt: skip
            began, began_cpu = time.perf_counter(), engine_cpu_s(engine)

            async def user(u: int) -> None:
                for t in range(args.turns):
                    prompt = history[u] + messages[u][t]
                    async with limiter:
                        out = await engine.generate(prompt, params)
                    answer = list(out.outputs[0].token_ids)
                    answers[(u, t)] = answer
                    history[u] = prompt + answer
                    first = out.metrics.time_to_first_token_s if out.metrics else None
                    if first is not None:
                        ttft.append(first)
                    bar.update(1)
                    await anyio.sleep(0)  # let other users queue their turns first

            async with anyio.create_task_group() as tg:
                for u in range(args.users):
                    tg.start_soon(user, u)
            wall, cpu = time.perf_counter() - began, engine_cpu_s(engine) - began_cpu
            bar.close()
            stats = engine.statistics()
    tokens = sum(len(a) for a in answers.values())
    ttft.sort()
    return {
        "mode": mode,
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_per_s": tokens / wall,
        "cpu_s": cpu,  # the engine's processes' CPU time (tools/proc_stats.py): steadier than wall
        "tok_per_cpu_s": tokens / cpu,
        "computed_prompt_tokens": stats.prefix_cache_query_tokens - stats.prefix_cache_hit_tokens,
        "step_time_s": stats.step_time_s,  # the executor's time in steps (thread hop included)
        "compute_time_s": stats.compute_time_s,  # of which the forward, LM head and sampling
        "ttft_median_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "ttft_mean_s": statistics.fmean(ttft),
        "prompt_tokens": stats.prefix_cache_query_tokens,
        "hit_tokens": {
            "device": stats.prefix_cache_device_hit_tokens,
            "host": stats.prefix_cache_host_hit_tokens,
            "disk": stats.prefix_cache_disk_hit_tokens,
        },
        "num_kv_offloads": stats.num_kv_offloads,
        "num_kv_spills": stats.num_kv_spills,
        "num_preemptions": stats.num_preemptions,
        "answers": {f"{u}/{t}": a for (u, t), a in sorted(answers.items())},
    }


def _block_bytes() -> int:
    import json

    from asyncpaged.tools.demo import default_model

    cfg = json.loads((Path(default_model()) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return int(2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 16 * 4)  # fp32, block 16


def _draw(report: dict[str, Any], path: Path) -> None:
    from asyncpaged.tools.plotting import pyplot

    plt = pyplot()
    summary = report["summary"]
    modes = list(summary)
    xs = list(range(len(modes)))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.8))
    ax1.bar([x - 0.2 for x in xs], [summary[m]["ttft_median_s"] * 1000 for m in modes],
            width=0.4, label="median")  # fmt: skip
    ax1.bar([x + 0.2 for x in xs], [summary[m]["ttft_p90_s"] * 1000 for m in modes],
            width=0.4, label="p90")  # fmt: skip
    ax1.set_ylabel("time to first token (ms)")
    ax1.legend()
    ax2.bar([x - 0.2 for x in xs], [summary[m]["tok_per_s"] for m in modes], width=0.4,
            label="per wall s")  # fmt: skip
    ax2.bar([x + 0.2 for x in xs], [summary[m]["tok_per_cpu_s"] for m in modes], width=0.4,
            label="per CPU s")  # fmt: skip
    ax2.set_ylabel("output tokens")
    ax2.legend()
    bottom = [0.0] * len(modes)
    parts = {
        "computed": [float(summary[m]["computed_prompt_tokens"]) for m in modes],
        **{f"{tier} hit": [float(summary[m]["hit_tokens"][tier]) for m in modes]
           for tier in ("device", "host", "disk")},
    }  # fmt: skip
    for label, heights in parts.items():
        ax3.bar(xs, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax3.set_ylabel("prompt tokens")
    ax3.legend(fontsize=8)
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(xs, modes)
    s = report["settings"]
    title = f"multi-turn chat: {s['users']} users x {s['turns']} turns, "
    fig.suptitle(title + f"{s['device_blocks']} device blocks; KV tiers off / host / host+disk")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch

    from asyncpaged.tools.bench_throughput import machine_info
    from asyncpaged.tools.plotting import save_report

    if args.threads:
        torch.set_num_threads(args.threads)
    block_bytes = _block_bytes()
    # Warm-up passes (discarded): oneDNN and the kernels build per shape on first use, which
    # would charge the first mode for every prefill length.
    for _ in range(args.warmup):
        for mode in MODES:
            anyio.run(_one_run, args, mode, block_bytes)
    runs = [anyio.run(_one_run, args, mode, block_bytes) for _ in range(args.repeats)
            for mode in MODES]  # fmt: skip
    summary: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: statistics.median(r[key] for r in mine) for key in SUMMARY_KEYS}
        summary[mode]["hit_tokens"] = mine[0]["hit_tokens"]
        summary[mode]["prompt_tokens"] = mine[0]["prompt_tokens"]
        summary[mode]["computed_prompt_tokens"] = mine[0]["computed_prompt_tokens"]
    same = len({tuple(map(tuple, r["answers"].values())) for r in runs}) == 1
    for r in runs:
        r.pop("answers")
    for mode in MODES:
        m = summary[mode]
        hits = m["hit_tokens"]
        print(f"{mode:10s} TTFT {m['ttft_median_s'] * 1000:7.1f} ms median, "
              f"{m['ttft_p90_s'] * 1000:7.1f} ms p90; {m['tok_per_s']:7.1f} output tok/s, "
              f"{m['tok_per_cpu_s']:7.1f} per CPU s, forward {m['compute_time_s']:.2f} s; "
              f"hits device {hits['device']} host {hits['host']} disk {hits['disk']} of "
              f"{m['prompt_tokens']} prompt tokens")  # fmt: skip
    print("tokens identical across modes" if same else "TOKENS DIFFER between modes")
    report = {
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "block_bytes": block_bytes,
        "machine": {
            **machine_info(),
            "torch_threads": torch.get_num_threads(),
        },
        "runs": runs,
        "summary": summary,
        "tokens_identical": same,
    }
    save_report(Path(args.output), "multiturn", report, lambda p: _draw(report, p))
    return 0 if same else 1


def add_parser(modes: Any) -> None:
    p = modes.add_parser(
        "multiturn", help="multi-turn chat TTFT and throughput with the KV tiers off/host/disk"
    )
    p.add_argument("--users", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="requests running at once")
    p.add_argument("--system-tokens", type=int, default=192, help="shared by every user")
    p.add_argument("--context-tokens", type=int, default=224, help="each user's own first text")
    p.add_argument("--message-tokens", type=int, default=16, help="each new user message")
    p.add_argument("--max-tokens", type=int, default=8, help="each answer")
    p.add_argument("--device-blocks", type=int, default=128, help="below the working set")
    p.add_argument("--host-blocks", type=int, default=1024, help="host tier of mode 'host'")
    p.add_argument("--small-host-blocks", type=int, default=64,
                   help="host tier of mode 'host+disk' (the rest spills to disk)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="measured runs of each mode")
    p.add_argument("--warmup", type=int, default=1, help="discarded passes over every mode")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument(
        "--executor-backend",
        choices=("auto", "thread", "process"),
        default="auto",
        help="where the model runner runs (EngineConfig.executor_backend)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench-results", help="folder for multiturn.json/png")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)
