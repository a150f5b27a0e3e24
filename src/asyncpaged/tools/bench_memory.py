"""``asyncpaged bench memory``: KV utilization and concurrency over time, paged vs reservation.

Runs the waste report's simulation (:func:`~asyncpaged.tools.waste_report.simulate`: the real
:class:`~asyncpaged.kv.block_pool.BlockPool` with ``--block-size`` 16 against Orca's contiguous
reservation policies max / pow2 / oracle, on ShareGPT-like and Alpaca-like lengths, first come
first served, one decode step per iteration) at a fixed budget of ``--budget-tokens`` KV slots,
and records at every step the KV utilization (tokens stored / slots reserved) and the number of
running sequences, until the workload drains.

Printed: the waste report's table (averages over the steps while requests wait, when the budget
is contended) and a concurrency table: mean and peak running sequences per policy, paged's mean
concurrency as a multiple of the policy's, and the steps each policy takes to finish the
workload. Written: ``memory.json`` (the results and the series, averaged over at most
``--max-points`` equal buckets of steps) and ``memory.png`` (utilization and running sequences
against the step, one column per workload).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from asyncpaged.tools.plotting import pyplot, save_report
from asyncpaged.tools.waste_report import (
    ALLOCATORS,
    DISTRIBUTIONS,
    LengthDistribution,
    StepSample,
    WasteResult,
    format_table,
    simulate,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRun:
    """One workload through one allocator: the waste result and its series over the steps.

    Point ``i`` of a series averages the steps ``step[i]`` to ``step[i + 1] - 1`` (1-based);
    with no more steps than ``max_points``, every step is its own point.
    """

    result: WasteResult
    num_steps_total: int  # every step until the workload drained, contended or not
    step: tuple[int, ...]
    utilization: tuple[float, ...]  # tokens stored / slots reserved
    num_running: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self.result),
            "num_steps_total": self.num_steps_total,
            "series": {
                "step": list(self.step),
                "utilization": list(self.utilization),
                "num_running": list(self.num_running),
            },
        }


def bucket_means(values: Sequence[float], max_points: int) -> tuple[list[int], list[float]]:
    """Split ``values`` into at most ``max_points`` near-equal runs of consecutive steps;
    returns each run's first step (1-based) and its mean."""
    if max_points < 1:
        raise ValueError(f"max_points must be at least 1, got {max_points}.")
    num_points = min(len(values), max_points)
    bounds = [len(values) * i // num_points for i in range(num_points + 1)]
    starts = [b + 1 for b in bounds[:-1]]
    means = [sum(values[a:b]) / (b - a) for a, b in pairwise(bounds)]
    return starts, means


def run_policy(
    dist: LengthDistribution,
    allocator: str,
    *,
    num_requests: int,
    budget_tokens: int,
    block_size: int,
    max_model_len: int,
    seed: int,
    max_points: int = 400,
) -> MemoryRun:
    trace: list[StepSample] = []
    result = simulate(
        dist,
        allocator,
        num_requests=num_requests,
        budget_tokens=budget_tokens,
        block_size=block_size if allocator == "paged" else 1,
        max_model_len=max_model_len,
        seed=seed,
        trace=trace,
    )
    step, utilization = bucket_means(
        [s.num_tokens / s.num_reserved_slots for s in trace], max_points
    )
    _, running = bucket_means([float(s.num_running) for s in trace], max_points)
    return MemoryRun(
        result=result,
        num_steps_total=len(trace),
        step=tuple(step),
        utilization=tuple(utilization),
        num_running=tuple(running),
    )


def format_concurrency_table(runs: Sequence[MemoryRun]) -> str:
    head = (
        f"{'workload':<9} {'allocator':<15} {'seqs mean':>9} {'seqs peak':>9} "
        f"{'paged x':>7} {'steps to drain':>14}"
    )
    lines = [head, "-" * len(head)]
    paged = {
        r.result.distribution: r.result.concurrent_mean
        for r in runs
        if r.result.allocator == "paged"
    }
    for run in runs:
        r = run.result
        ratio = paged.get(r.distribution, float("nan")) / r.concurrent_mean
        lines.append(
            f"{r.distribution:<9} {r.allocator:<15} {r.concurrent_mean:>9.1f} "
            f"{r.concurrent_max:>9} {ratio:>6.2f}x {run.num_steps_total:>14}"
        )
    return "\n".join(lines)


def plot(runs: Sequence[MemoryRun], path: Path, title: str) -> None:
    """Utilization (top) and running sequences (bottom) against the step, one column per
    workload. The step axis stops at 4x the paged run's length; a run drained later is cut off
    there (its length is in its label)."""
    plt = pyplot()
    names = list(dict.fromkeys(r.result.distribution for r in runs))
    fig, axes = plt.subplots(
        2, len(names), figsize=(6.5 * len(names), 8), squeeze=False, constrained_layout=True
    )
    for col, name in enumerate(names):
        top, bottom = axes[0][col], axes[1][col]
        group = [r for r in runs if r.result.distribution == name]
        longest = max(r.num_steps_total for r in group)
        paged = [r.num_steps_total for r in group if r.result.allocator == "paged"]
        x_max = min(longest, 4 * paged[0]) if paged else longest
        for run in group:
            r = run.result
            label = f"paged, block {r.block_size}" if r.allocator == "paged" else r.allocator
            label += f" (drains at step {run.num_steps_total})"
            width = 2.2 if r.allocator == "paged" else 1.2
            top.plot(run.step, [100 * u for u in run.utilization], label=label, linewidth=width)
            bottom.plot(run.step, run.num_running, label=label, linewidth=width)
        top.set_title(f"{name}: KV utilization (tokens stored / slots reserved)")
        top.set_ylabel("%")
        top.set_ylim(0, 105)
        bottom.set_title(f"{name}: running sequences")
        bottom.set_ylabel("sequences")
        bottom.set_ylim(bottom=0)
        for ax in (top, bottom):
            ax.set_xlim(0, x_max * 1.02)
            ax.set_xlabel("decode step")
            ax.grid(alpha=0.3)
        bottom.legend(loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    runs: list[MemoryRun] = []
    for name in args.distributions.split(","):
        for allocator in ALLOCATORS:
            runs.append(
                run_policy(
                    DISTRIBUTIONS[name],
                    allocator,
                    num_requests=args.num_requests,
                    budget_tokens=args.budget_tokens,
                    block_size=args.block_size,
                    max_model_len=args.max_model_len,
                    seed=args.seed,
                    max_points=args.max_points,
                )
            )
    header = (
        f"KV budget {args.budget_tokens} token slots, {args.num_requests} requests per workload, "
        f"max_model_len {args.max_model_len}, seed {args.seed}"
    )
    print(
        f"{header}; utilization = tokens stored / slots reserved, over the steps while "
        "requests wait."
    )
    print(format_table([r.result for r in runs]))
    print(
        "\nRunning sequences at this budget, over the steps while requests wait (paged x = "
        "paged's mean / this one's; steps to drain: until every request finished):"
    )
    print(format_concurrency_table(runs))
    report = {
        "budget_tokens": args.budget_tokens,
        "num_requests": args.num_requests,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "results": [r.to_json() for r in runs],
    }
    save_report(Path(args.output), "memory", report, lambda png: plot(runs, png, header))
    return 0


def add_parser(modes: Any) -> None:
    p = modes.add_parser("memory", help="KV utilization and concurrency: paged vs reservation")
    p.add_argument("--distributions", default="sharegpt,alpaca", help="comma-separated")
    p.add_argument("--num-requests", type=int, default=1000, help="per workload")
    p.add_argument("--budget-tokens", type=int, default=16384, help="KV slots (tokens)")
    p.add_argument("--block-size", type=int, default=16, help="of the paged pool")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-points", type=int, default=400, help="per series in JSON and plot")
    p.add_argument("--output", default="bench-results", help="folder for memory.json and .png")
    p.set_defaults(func=run)
