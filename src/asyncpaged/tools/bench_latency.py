"""``asyncpaged bench latency``: TTFT, TPOT, ITL and end-to-end latency against the request rate.

The reference workload (:mod:`~asyncpaged.tools.bench_workload`; ``--quick`` for the small one)
is sent at each rate of ``--rates``: requests arrive by a Poisson process (exponential gaps drawn
from ``random.Random(seed)``, the same draws scaled for every rate; ``inf`` sends them all at
once). Each request is a streaming client (``output_kind=DELTA``) timed with
``time.perf_counter`` on the event loop, that is as the caller sees it. The metrics are those of
vLLM's ``benchmark_serving`` (``calculate_metrics``):

* TTFT: the first streamed chunk's arrival - the send time.
* TPOT: (E2E - TTFT) / (output tokens - 1), over the requests with more than one output token.
* ITL: every gap between two consecutive chunks of a request, all requests pooled. A chunk is a
  streamed output carrying tokens; a client that falls behind gets several tokens in one chunk
  (DELTA outputs coalesce), so there can be fewer ITLs than tokens, as in vLLM.
* E2E latency: the last chunk's arrival - the send time.

Each is summarized by its mean, median and p99 (linear interpolation, numpy's default). Request
and output-token throughput divide by the duration from the first send to the last chunk.

Every rate gets a fresh engine (float32, the default KV cache and scheduler limits) and one
warm-up request before its clock starts, so no rate inherits another's prefix cache or queue.
The rates run one after the other in one process, with ``--threads`` torch threads (1 by
default: see docs on benchmark hygiene).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from asyncpaged.tools.bench_workload import Workload, build_checkpoint, make_workload
from asyncpaged.tools.plotting import pyplot, save_report

if TYPE_CHECKING:
    from asyncpaged.engine.async_engine import AsyncEngine

DEFAULT_RATES = "0.5,1,2,4,inf"


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestTimeline:
    """One streamed request as its client saw it, in ``time.perf_counter`` seconds."""

    send_s: float
    chunk_s: tuple[float, ...]  # arrival of each streamed output that carried tokens
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.send_s

    @property
    def e2e_s(self) -> float:
        return self.chunk_s[-1] - self.send_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; ``None`` with a single output token."""
        if self.num_output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_s)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between ranks (``numpy.percentile``)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """Mean, median and p99 of one metric, in milliseconds (all 0 with no samples, as vLLM)."""

    mean_ms: float
    median_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_s: Sequence[float]) -> Summary:
        if not values_s:
            return cls(mean_ms=0.0, median_ms=0.0, p99_ms=0.0)
        return cls(
            mean_ms=1000 * sum(values_s) / len(values_s),
            median_ms=1000 * percentile(values_s, 50),
            p99_ms=1000 * percentile(values_s, 99),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RateResult:
    """The latency metrics of one request rate."""

    request_rate: float  # req/s; inf: all at once
    num_requests: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    num_chunks: int
    num_itls: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2e: Summary
    num_preemptions: int

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["request_rate"] = rate_label(self.request_rate)  # JSON has no infinity
        return data


def compute_metrics(
    timelines: Sequence[RequestTimeline],
    duration_s: float,
    *,
    request_rate: float,
    num_preemptions: int = 0,
) -> RateResult:
    """vLLM's ``calculate_metrics`` over finished requests."""
    tpots = [t.tpot_s for t in timelines if t.tpot_s is not None]
    itls = [gap for t in timelines for gap in t.itls_s]
    total_output = sum(t.num_output_tokens for t in timelines)
    return RateResult(
        request_rate=request_rate,
        num_requests=len(timelines),
        duration_s=duration_s,
        total_input_tokens=sum(t.num_prompt_tokens for t in timelines),
        total_output_tokens=total_output,
        num_chunks=sum(len(t.chunk_s) for t in timelines),
        num_itls=len(itls),
        request_throughput=len(timelines) / duration_s,
        output_throughput=total_output / duration_s,
        ttft=Summary.of([t.ttft_s for t in timelines]),
        tpot=Summary.of(tpots),
        itl=Summary.of(itls),
        e2e=Summary.of([t.e2e_s for t in timelines]),
        num_preemptions=num_preemptions,
    )


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times from the start, in seconds: a Poisson process, or all zero for ``inf``."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(1.0) / request_rate
    return offsets


async def stream_request(
    engine: AsyncEngine, prompt: Sequence[int], max_tokens: int
) -> RequestTimeline:
    """Send one greedy request (EOS ignored) and time its DELTA chunks as its client sees them.

    If cancelled midway, the request is aborted (as any :class:`RequestStream` is)."""
    from asyncpaged.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    chunks: list[float] = []
    num_output = 0
    send = time.perf_counter()
    async for out in engine.generate(prompt, params):
        if num_new := len(out.outputs[0].token_ids):
            chunks.append(time.perf_counter())
            num_output += num_new
    return RequestTimeline(send_s=send, chunk_s=tuple(chunks), num_prompt_tokens=len(prompt),
                           num_output_tokens=num_output)  # fmt: skip


async def bench_rate(
    model: Path, workload: Workload, request_rate: float, *, seed: int = 0, progress: bool = True
) -> RateResult:
    """Send ``workload`` at ``request_rate`` to a fresh engine (after a warm-up request).

    If cancelled midway, the engine is closed and its unfinished requests are aborted."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # a transformers dependency

    from asyncpaged.config import EngineConfig
    from asyncpaged.engine.async_engine import AsyncEngine
    from asyncpaged.sampling_params import SamplingParams

    offsets = arrival_offsets(workload.num_requests, request_rate, seed)
    timelines: list[RequestTimeline | None] = [None] * workload.num_requests
    async with AsyncEngine(EngineConfig(model=str(model), dtype="float32", seed=seed)) as engine:
        await engine.generate(workload.prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
        label = f"rate {rate_label(request_rate)}"
        bar = tqdm(total=workload.num_requests, desc=label, unit="req", file=sys.stderr,
                   disable=not progress, leave=False)  # fmt: skip
        with bar:

            async def client(i: int, start: float) -> None:
                await anyio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
                timelines[i] = await stream_request(
                    engine, workload.prompts[i], workload.max_tokens[i]
                )
                bar.update(1)

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(workload.num_requests):
                    tg.start_soon(client, i, start)
            duration = time.perf_counter() - start
        await engine.wait_idle()
        num_preemptions = engine.statistics().num_preemptions
    done = [t for t in timelines if t is not None]
    assert len(done) == workload.num_requests, "a client finished without its timeline"
    return compute_metrics(
        done, duration, request_rate=request_rate, num_preemptions=num_preemptions
    )


def rate_label(request_rate: float) -> str:
    return "inf" if math.isinf(request_rate) else f"{request_rate:g}"


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,inf"`` -> ``[0.5, 1.0, inf]``; every rate must be positive."""
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers or 'inf', got {text!r}.") from None
    if not rates or any(not r > 0 for r in rates):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text!r}.")
    return rates


def format_table(results: Sequence[RateResult]) -> str:
    groups = "".join(f" | {name:^25}" for name in ("TTFT ms", "TPOT ms", "ITL ms", "E2E ms"))
    stats = " | " + "  ".join(f"{s:>7}" for s in ("mean", "p50", "p99"))
    head2 = f"{'rate':>5} {'req/s':>6} {'tok/s':>6}" + stats * 4
    lines = [f"{'':>19}" + groups, head2, "-" * len(head2)]
    for r in results:
        row = f"{rate_label(r.request_rate):>5} {r.request_throughput:>6.2f} "
        row += f"{r.output_throughput:>6.0f}"
        for s in (r.ttft, r.tpot, r.itl, r.e2e):
            row += " | " + "  ".join(f"{v:>7.1f}" for v in (s.mean_ms, s.median_ms, s.p99_ms))
        lines.append(row)
    return "\n".join(lines)


def plot(results: Sequence[RateResult], path: Path, title: str) -> None:
    """TTFT, TPOT and E2E latency (mean and p99) against the request rate."""
    plt = pyplot()
    x = list(range(len(results)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for ax, (name, key) in zip(
        axes, (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E latency", "e2e")), strict=True
    ):
        summaries = [getattr(r, key) for r in results]
        ax.plot(x, [s.mean_ms for s in summaries], marker="o", label="mean")
        ax.plot(x, [s.p99_ms for s in summaries], marker="s", linestyle="--", label="p99")
        ax.set_xticks(x, [rate_label(r.request_rate) for r in results])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch

    rates: list[float] = args.rates
    workload = make_workload(quick=args.quick, num_requests=args.num_requests, seed=args.seed)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    results: list[RateResult] = []
    try:
        with tempfile.TemporaryDirectory(prefix="asyncpaged-bench-") as tmp:
            model = build_checkpoint(workload, Path(args.checkpoint_dir or tmp))
            for rate in rates:
                bench = partial(
                    bench_rate, model, workload, rate, seed=args.seed, progress=not args.no_progress
                )
                results.append(anyio.run(bench))
    finally:
        torch.set_num_threads(previous_threads)
    header = (
        f"{workload.describe()}\ntorch threads {args.threads}, seed {args.seed}, "
        "Poisson arrivals, a fresh engine per rate after a warm-up request"
    )
    print(header)
    print(format_table(results))
    report = {
        "workload": workload.describe(),
        "model_config": workload.model_config,
        "threads": args.threads,
        "seed": args.seed,
        "results": [r.to_json() for r in results],
    }
    save_report(Path(args.output), "latency", report, lambda png: plot(results, png, header))
    return 0


def add_parser(modes: Any) -> None:
    p = modes.add_parser("latency", help="TTFT / TPOT / ITL / E2E latency against request rate")
    p.add_argument("--quick", action="store_true", help="the small workload (smoke runs, tests)")
    p.add_argument(
        "--rates",
        type=parse_rates,
        default=parse_rates(DEFAULT_RATES),
        help=f"request rates in req/s, 'inf' = all at once (default {DEFAULT_RATES})",
    )
    p.add_argument("--num-requests", type=int, help="requests per rate (default: the workload's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--output", default="bench-results", help="folder for latency.json and .png")
    p.add_argument("--checkpoint-dir", help="keep the workload's checkpoint here (reused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)
