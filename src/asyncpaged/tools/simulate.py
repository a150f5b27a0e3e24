"""``asyncpaged simulate``: capacity planning on a CPU with the engine's own scheduler and pool.

Sweeps request rates for the paged engine and the contiguous-reservation baselines, prints one
row per configuration, and can write the results as JSON and two PNGs: normalized latency
against request rate (the shape of the vLLM paper's Figure 12) and KV utilization per system
(its Figure 2).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asyncpaged.sim.presets import GPUS, MODELS, ModelShape, num_kv_blocks
from asyncpaged.sim.results import SimResult, simulate
from asyncpaged.sim.simulator import SYSTEMS
from asyncpaged.sim.workload import WorkloadSpec
from asyncpaged.tools.plotting import pyplot
from asyncpaged.tools.waste_report import DISTRIBUTIONS


def sustainable_rate(results: list[SimResult], system: str, limit_s: float) -> float:
    """The highest swept rate at which ``system``'s normalized latency stays within
    ``limit_s`` per token (0 if none does)."""
    ok = [r.rate for r in results if r.system == system and r.normalized_latency_s <= limit_s]
    return max(ok, default=0.0)


def format_table(results: list[SimResult]) -> str:
    head = (
        f"{'system':<12} {'rate':>5} {'req/s':>6} {'tok/s':>7} {'norm lat':>8} {'util':>6} "
        f"{'util@pk':>7} {'KV mem':>6} {'batch':>6} {'max':>4} {'preempt':>7} {'swap MB':>8} "
        f"{'wall s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        swap_mb = (r.swap_out_bytes + r.swap_in_bytes) / 1e6
        lines.append(
            f"{r.system:<12} {r.rate:>5.2f} {r.throughput_rps:>6.2f} "
            f"{r.throughput_tokens_per_s:>7.0f} {r.normalized_latency_s:>8.3f} "
            f"{r.kv_util_mean:>6.1%} {r.kv_util_peak:>7.1%} {r.kv_occupancy_mean:>6.1%} "
            f"{r.batch_size_mean:>6.1f} "
            f"{r.batch_size_max:>4} {r.num_preemptions:>7} {swap_mb:>8.0f} {r.wall_s:>6.1f}"
        )
    return "\n".join(lines)


def plot_latency(results: list[SimResult], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(r.system for r in results):
        rows = sorted((r.rate, r.normalized_latency_s) for r in results if r.system == system)
        ax.plot([x for x, _ in rows], [y for _, y in rows], marker="o", label=system)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_ylim(0, 1.0)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_utilization(results: list[SimResult], path: Path, title: str) -> None:
    """Share of KV memory holding token states (the paper's Figure 2) for each system at the
    highest rate it was run at, over the steps while requests waited."""
    plt = pyplot()
    last = {r.system: r for r in sorted(results, key=lambda r: r.rate)}
    names = list(last)
    stored = [last[n].kv_occupancy_mean * 100 for n in names]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, stored, label="token states")
    other = [100 - s for s in stored]
    ax.bar(names, other, bottom=stored, label="reserved, fragmented or free", alpha=0.4)
    for i, s in enumerate(stored):
        ax.text(i, s / 2, f"{s:.1f}%", ha="center")
    ax.set_ylabel("share of KV memory (%)")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_batch(results: list[SimResult], path: Path, title: str) -> None:
    """Batch size over time of each system at the highest rate it was run at."""
    plt = pyplot()
    last = {r.system: r for r in sorted(results, key=lambda r: r.rate)}
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, r in last.items():
        ax.plot([t for t, _, _ in r.timeline], [b for _, b, _ in r.timeline], label=system)
    rate = max(r.rate for r in last.values())
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences per step")
    ax.set_title(f"{title}, {rate:g} req/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _model(name: str) -> ModelShape:
    if name in MODELS:
        return MODELS[name]
    return ModelShape.from_hf_config(name)  # a config.json, or a directory holding one


def run(args: argparse.Namespace) -> int:
    model = _model(args.model)
    gpu = GPUS[args.gpu]
    blocks = num_kv_blocks(
        model,
        gpu,
        block_size=args.block_size,
        num_gpus=args.num_gpus,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    results: list[SimResult] = []
    start = time.perf_counter()
    for system in args.systems.split(","):
        for rate in (float(x) for x in args.rates.split(",")):
            workload = WorkloadSpec(
                distribution=args.distribution,
                num_requests=args.num_requests,
                rate=rate,
                n=args.n,
                beam_width=args.beam_width,
                shared_prefix_len=args.shared_prefix_len,
                max_model_len=model.max_model_len,
                seed=args.seed,
            )
            results.append(
                simulate(
                    workload,
                    model=model,
                    gpu=gpu,
                    system=system,
                    block_size=args.block_size,
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    num_gpus=args.num_gpus,
                    num_device_blocks=blocks,
                    swap_space_bytes=args.swap_space_gib << 30,
                    preemption_mode=args.preemption_mode,
                    paged_overhead=args.paged_overhead,
                    placement=args.placement,
                    seed=args.seed,
                )
            )
    wall = time.perf_counter() - start
    title = f"{model.name} on {args.num_gpus} x {gpu.name}, {args.distribution}"
    lines = [
        f"{title}: {blocks} KV blocks of {args.block_size} tokens "
        f"({blocks * args.block_size} tokens, {model.kv_bytes_per_token / 1024:.0f} KiB each), "
        f"{args.num_requests} requests per run, n={args.n}, beam={args.beam_width}, "
        f"shared prefix {args.shared_prefix_len}, baseline placement {args.placement}; "
        f"{wall:.1f} s in all.",
        format_table(results),
        "",
        f"highest rate with normalized latency <= {args.latency_limit} s/token:",
    ]
    for system in dict.fromkeys(r.system for r in results):
        lines.append(f"  {system:<12} {sustainable_rate(results, system, args.latency_limit):.2f}")
    print("\n".join(lines))
    if args.json:
        rows = [{**asdict(r), "timeline": list(r.timeline)} for r in results]
        Path(args.json).write_text(json.dumps(rows, indent=1, default=_json_float))
    if args.plot_prefix:
        prefix = Path(args.plot_prefix)
        plot_latency(results, prefix.with_name(prefix.name + "_latency.png"), title)
        plot_utilization(results, prefix.with_name(prefix.name + "_utilization.png"), title)
        plot_batch(results, prefix.with_name(prefix.name + "_batch.png"), title)
    return 0


def _json_float(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="replay paper workloads on a simulated GPU")
    p.add_argument(
        "--model", default="opt-13b", help=f"{', '.join(MODELS)}, or a path to a HF config.json"
    )
    p.add_argument("--gpu", default="a100-40gb", choices=sorted(GPUS))
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rates", default="0.25,0.5,1,1.5,2,2.5,3", help="requests/s, comma-separated")
    p.add_argument("--distribution", default="sharegpt", choices=sorted(DISTRIBUTIONS))
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--n", type=int, default=1, help="parallel samples per request")
    p.add_argument("--beam-width", type=int, default=1)
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--swap-space-gib", type=int, default=0)
    p.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap"))
    p.add_argument(
        "--paged-overhead",
        type=float,
        default=0.2,
        help="extra attention-kernel time of paging (the paper: 0.20-0.26)",
    )
    p.add_argument(
        "--placement",
        default="buddy",
        choices=("buddy", "first-fit"),
        help="how the orca-* baselines place each request's contiguous reservation (the paper's "
        "Orca: buddy allocation)",
    )
    p.add_argument("--latency-limit", type=float, default=0.4, help="s/token for the summary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every result (with its timeline) to this file")
    p.add_argument(
        "--plot-prefix",
        help="write PREFIX_latency.png, PREFIX_utilization.png and PREFIX_batch.png",
    )
    p.set_defaults(func=run)
