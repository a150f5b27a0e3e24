"""``asyncpaged bench memory``: KV utilization and concurrency over time, paged vs reservation.

Runs the waste report's simulation (:func:`~asyncpaged.tools.waste_report.simulate`: the real
:class:`~asyncpaged.kv.block_pool.BlockPool` with ``--block-size`` 16 against Orca's contiguous
reservation policies max / pow2 / oracle, on ShareGPT-like and Alpaca-like lengths, first come
first served, one decode step per iteration) at a fixed budget of ``--budget-tokens`` KV slots,
and records at every step the KV utilization (tokens stored / slots reserved) and the number of
running sequences, until the workload drains.

With ``--kv-cache-bytes`` the budget is bytes instead: for each of ``--kv-cache-dtypes`` (the
values of ``EngineConfig.kv_cache_dtype``) the blocks that many bytes hold for a model of
``--kv-shape`` (layers, KV heads, head dim; the reference workload's by default), as the engine
counts them (``KVShape``: an int8 / fp8 block's scales included), so one run compares what each
KV dtype holds in the same memory.

Printed: the waste report's table (averages over the steps while requests wait, when the budget
is contended) and a concurrency table: mean and peak running sequences per policy (and KV dtype),
paged's mean concurrency as a multiple of the policy's, and the steps each policy takes to finish
the workload; with ``--kv-cache-bytes`` a capacity table too: per KV dtype the bytes per token,
the blocks, paged's mean and peak running sequences, and the blocks and peak as a multiple of
bfloat16's. Written: ``memory.json`` (the results and the series, averaged over at most
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
    kv_cache_dtype: str | None  # the KV dtype the budget was counted in (None: token slots)
    num_blocks: int  # the budget in blocks of the paged pool's size
    num_steps_total: int  # every step until the workload drained, contended or not
    step: tuple[int, ...]
    utilization: tuple[float, ...]  # tokens stored / slots reserved
    num_running: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self.result),
            "kv_cache_dtype": self.kv_cache_dtype,
            "num_blocks": self.num_blocks,
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
    kv_cache_dtype: str | None = None,
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
        kv_cache_dtype=kv_cache_dtype,
        num_blocks=budget_tokens // block_size,
        num_steps_total=len(trace),
        step=tuple(step),
        utilization=tuple(utilization),
        num_running=tuple(running),
    )


def format_concurrency_table(runs: Sequence[MemoryRun]) -> str:
    head = (
        f"{'workload':<9} {'kv dtype':<9} {'allocator':<15} {'seqs mean':>9} {'seqs peak':>9} "
        f"{'paged x':>7} {'steps to drain':>14}"
    )
    lines = [head, "-" * len(head)]
    paged = {
        (r.result.distribution, r.kv_cache_dtype): r.result.concurrent_mean
        for r in runs
        if r.result.allocator == "paged"
    }
    for run in runs:
        r = run.result
        ratio = paged.get((r.distribution, run.kv_cache_dtype), float("nan")) / r.concurrent_mean
        lines.append(
            f"{r.distribution:<9} {run.kv_cache_dtype or '-':<9} {r.allocator:<15} "
            f"{r.concurrent_mean:>9.1f} {r.concurrent_max:>9} {ratio:>6.2f}x "
            f"{run.num_steps_total:>14}"
        )
    return "\n".join(lines)


def format_capacity_table(runs: Sequence[MemoryRun], token_bytes: dict[str, int]) -> str:
    """Paged runs per KV dtype: bytes per token, blocks, running sequences, and the blocks and
    peak sequences as a multiple of bfloat16's (when it ran)."""
    head = (
        f"{'workload':<9} {'kv dtype':<9} {'bytes/token':>11} {'blocks':>7} {'seqs mean':>9} "
        f"{'seqs peak':>9} {'blocks x bf16':>13} {'peak x bf16':>11}"
    )
    lines = [head, "-" * len(head)]
    paged = [r for r in runs if r.result.allocator == "paged" and r.kv_cache_dtype is not None]
    bf16 = {r.result.distribution: r for r in paged if r.kv_cache_dtype == "bfloat16"}
    for run in paged:
        r, base = run.result, bf16.get(run.result.distribution)
        blocks_x = run.num_blocks / base.num_blocks if base else float("nan")
        peak_x = r.concurrent_max / base.result.concurrent_max if base else float("nan")
        assert run.kv_cache_dtype is not None
        lines.append(
            f"{r.distribution:<9} {run.kv_cache_dtype:<9} {token_bytes[run.kv_cache_dtype]:>11} "
            f"{run.num_blocks:>7} {r.concurrent_mean:>9.1f} {r.concurrent_max:>9} "
            f"{blocks_x:>12.2f}x {peak_x:>10.2f}x"
        )
    return "\n".join(lines)


def kv_budgets(
    kv_cache_bytes: int, kv_dtypes: Sequence[str], kv_shape: tuple[int, int, int], block_size: int
) -> tuple[dict[str, int], dict[str, int]]:
    """(token slots, bytes per token) for each KV dtype: the blocks ``kv_cache_bytes`` hold
    for a model of ``kv_shape`` (layers, KV heads, head dim), counted as the engine counts
    them (``KVShape``, an int8 / fp8 block's scales included)."""
    import torch

    from asyncpaged.config import KVShape
    from asyncpaged.model.kv_quant import KV_SCALE_DTYPE, is_quantized, kv_cache_torch_dtype

    slots, token_bytes = {}, {}
    layers, kv_heads, head_dim = kv_shape
    for name in kv_dtypes:
        dtype = kv_cache_torch_dtype(name, torch.float32)
        scale_bytes = KV_SCALE_DTYPE.itemsize if is_quantized(dtype) else 0
        shape = KVShape(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        dtype_bytes=dtype.itemsize, scale_bytes=scale_bytes)  # fmt: skip
        block = shape.block_bytes(block_size)
        slots[name] = kv_cache_bytes // block * block_size
        token_bytes[name] = block // block_size
    return slots, token_bytes


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
            if run.kv_cache_dtype is not None:
                label += f", {run.kv_cache_dtype}"
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
    budgets: dict[str | None, int] = {None: args.budget_tokens}
    token_bytes: dict[str, int] = {}
    if args.kv_cache_bytes is not None:
        kv_dtypes = [d for d in args.kv_cache_dtypes.split(",") if d]
        dims = [int(x) for x in args.kv_shape.split(",")]
        if len(dims) != 3:
            raise SystemExit(f"--kv-shape is LAYERS,KV_HEADS,HEAD_DIM, got {args.kv_shape!r}")
        shape = (dims[0], dims[1], dims[2])
        slots, token_bytes = kv_budgets(args.kv_cache_bytes, kv_dtypes, shape, args.block_size)
        budgets = {}
        for name, num_slots in slots.items():
            budgets[name] = num_slots
    for name in args.distributions.split(","):
        for kv_dtype, budget in budgets.items():
            for allocator in ALLOCATORS:
                runs.append(
                    run_policy(
                        DISTRIBUTIONS[name],
                        allocator,
                        num_requests=args.num_requests,
                        budget_tokens=budget,
                        block_size=args.block_size,
                        max_model_len=args.max_model_len,
                        seed=args.seed,
                        max_points=args.max_points,
                        kv_cache_dtype=kv_dtype,
                    )
                )
    budget_text = f"{args.budget_tokens} token slots"
    if args.kv_cache_bytes is not None:
        budget_text = (f"{args.kv_cache_bytes} bytes (KV shape {args.kv_shape}: "
                       + ", ".join(f"{d} {n} slots" for d, n in budgets.items()) + ")")  # fmt: skip
    header = (
        f"KV budget {budget_text}, {args.num_requests} requests per workload, "
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
    if token_bytes:
        print("\nThe same bytes in each KV dtype (paged):")
        print(format_capacity_table(runs, token_bytes))
    report = {
        "budget_tokens": args.budget_tokens,
        "kv_cache_bytes": args.kv_cache_bytes,
        "kv_shape": args.kv_shape,
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
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        help="a budget in bytes instead of --budget-tokens, counted per KV dtype",
    )
    p.add_argument(
        "--kv-cache-dtypes",
        default="float32,bfloat16,int8,fp8",
        help="with --kv-cache-bytes: comma-separated kv_cache_dtype values",
    )
    p.add_argument("--kv-shape", default="6,2,64",
                   help="with --kv-cache-bytes: LAYERS,KV_HEADS,HEAD_DIM (default: the "
                        "reference workload's model)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-points", type=int, default=400, help="per series in JSON and plot")
    p.add_argument("--output", default="bench-results", help="folder for memory.json and .png")
    p.set_defaults(func=run)
