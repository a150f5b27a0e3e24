"""``asyncpaged bench soak --minutes N``: mixed, hostile load on the built-in model for N minutes.

``--concurrency`` client tasks each loop over random requests until time is up: short and long
prompts (ids and text), ``n > 1``, ``best_of``, beam search, seeds, stop strings, DELTA streams,
and random fates (read to the end, cancel the waiter, ``engine.abort``, ``aclose`` midway, break
out of ``async for`` without closing, never read), plus a share of invalid requests that must be
refused (``InvalidRequestError``). A small KV cache (``--num-device-blocks``) with swap keeps
the engine under memory pressure (preemption by swap). Measured meanwhile:

* RSS every ``--rss-every-s`` seconds: this process's plus, with the runner in its own
  process (the default on a CPU with 2+ cores), that process's, where the KV cache and the
  forward's buffers live (``tools/proc_stats.py``); growth is the last sample over the first
  after the warm-up (``--warmup-frac`` of the run).
* Host-loop lag: a probe task sleeps 5 ms in a loop and records how late it wakes (p50, p99,
  max), and every cyclic-GC pass is timed per generation (``gc.callbacks``). Both go into
  fixed-size histograms (:class:`Durations`): a list of every sample would itself grow the RSS
  being measured (~11 MiB over 30 minutes).
* At the end, after ``wait_idle``: leaked blocks (device blocks neither free nor cached, host
  blocks not free; must be 0), requests left, and unexpected errors (anything but a refusal of
  an invalid request), which must be 0.

``--output DIR`` receives ``soak.json``. Exit status 0 when nothing leaked, nothing unexpected
was raised and RSS grew at most ``--max-rss-growth`` (2%) after the warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from asyncpaged.tools.proc_stats import engine_rss_mib

PROBE_S = 0.005
FATES = ("keep", "keep", "keep", "cancel", "abort", "close", "drop")
KINDS = ("short", "short", "long", "text", "parallel", "best_of", "beam", "stop", "invalid")


class Durations:
    """Durations in a fixed array of log-spaced bins, 1% wide, from 1 us to ~100 s (the ends
    collect the rest): recording allocates nothing that stays, and a percentile is within 1%.

    Invariant: ``sum(counts) == count`` and ``max_s`` is the largest duration recorded.
    """

    MIN_S = 1e-6
    STEP = math.log(1.01)
    NUM_BINS = 1 + int(math.log(1e8) / STEP)

    def __init__(self) -> None:
        self.counts = array("q", bytes(8 * self.NUM_BINS))
        self.count = 0
        self.max_s = 0.0

    def record(self, seconds: float) -> None:
        index = 0 if seconds <= self.MIN_S else 1 + int(math.log(seconds / self.MIN_S) / self.STEP)
        self.counts[min(index, self.NUM_BINS - 1)] += 1
        self.count += 1
        self.max_s = max(self.max_s, seconds)

    def percentile(self, q: float) -> float:
        """The ``q`` quantile (nearest rank) in seconds: its bin's upper edge, at most the max
        (the max itself in the overflow bin)."""
        if not self.count:
            return 0.0
        rank = min(self.count - 1, int(q * (self.count - 1) + 0.5))
        seen = 0
        for index, n in enumerate(self.counts):
            seen += n
            if seen > rank:
                if index == self.NUM_BINS - 1:  # the overflow bin: beyond its edge
                    return self.max_s
                return min(self.max_s, self.MIN_S * math.exp(index * self.STEP))
        return self.max_s  # pragma: no cover - the counts sum to count


@dataclass
class SoakState:
    """What the clients, the probe and the RSS sampler record."""

    started: float
    deadline: float
    lags: Durations = field(default_factory=Durations)
    recent_lags_s: deque[float] = field(default_factory=lambda: deque(maxlen=2000))
    rss: list[tuple[float, float]] = field(default_factory=list)  # (s since start, MiB)
    gc_pauses: dict[int, Durations] = field(
        default_factory=lambda: {g: Durations() for g in range(3)}
    )
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    num_requests: int = 0
    num_tokens: int = 0
    gc_freeze_count: int = 0  # objects gc.freeze() took out of the GC's walks, while running
    runner_rss_mib: float = 0.0  # the runner process's share of the last RSS sample


def percentile(values: list[float] | deque[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of a few values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _gc_timer(state: SoakState) -> Any:
    began: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            state.gc_pauses[info["generation"]].record(time.perf_counter() - began[0])

    return callback


async def _probe(state: SoakState) -> None:
    while time.monotonic() < state.deadline:
        start = time.perf_counter()
        await anyio.sleep(PROBE_S)
        lag = max(0.0, time.perf_counter() - start - PROBE_S)
        state.lags.record(lag)
        state.recent_lags_s.append(lag)


async def _sample_rss(state: SoakState, engine: Any, every_s: float, progress: bool) -> None:
    while time.monotonic() < state.deadline:
        now = time.monotonic() - state.started
        state.rss.append((now, sum(engine_rss_mib(engine))))
        if progress:
            p99 = percentile(state.recent_lags_s, 0.99) * 1e3
            print(f"[soak {now:6.0f}s] rss {state.rss[-1][1]:7.1f} MiB, "
                  f"{state.num_requests} requests, {state.num_tokens} tokens, lag p99 (recent) "
                  f"{p99:.1f} ms, errors {sum(state.errors.values())}", flush=True)  # fmt: skip
        await anyio.sleep(every_s)


def _request(engine: Any, rng: random.Random, kind: str, rid: str) -> Any:
    """Start one request of ``kind``; returns its stream (raises for "invalid")."""
    from asyncpaged import RequestOutputKind, SamplingParams
    from asyncpaged.sampling_params import BeamSearchParams

    vocab = engine.vocab_size
    ids = [rng.randrange(4, vocab) for _ in range(rng.randint(4, 32))]
    max_tokens = rng.randint(4, 48)
    seed = rng.choice([None, rng.randrange(1 << 30)])
    kind_out = rng.choice(list(RequestOutputKind))
    if kind == "long":
        ids = [rng.randrange(4, vocab) for _ in range(rng.randint(150, 320))]
    if kind == "beam":
        width = rng.randint(2, 3)
        return engine.beam_search(ids, BeamSearchParams(beam_width=width, max_tokens=max_tokens),
                                  request_id=rid)  # fmt: skip
    if kind == "invalid":
        bad: Callable[[], Any] = rng.choice([
            lambda: engine.generate("ab\ud800cd", request_id=rid),
            lambda: engine.generate(ids, SamplingParams(n=10**6), request_id=rid),
            lambda: engine.generate(ids, SamplingParams(min_tokens=2, stop_token_ids=[10**7])),
            lambda: engine.generate(ids, cache_salt=rng.choice([3, b"x", "\ud800"])),
            lambda: engine.generate(rng.choice([None, 5, b"abc", {1: 2}, [True]])),
            lambda: engine.generate("x" * 10_000_000),
        ])  # fmt: skip
        return bad()
    n = rng.randint(2, 3) if kind in ("parallel", "best_of") else 1
    best_of = kind == "best_of"  # sampled (greedy refuses best_of > n), one final output
    params = SamplingParams(
        n=n, best_of=n + 1 if best_of else None,
        temperature=0.8 if best_of else rng.choice([0.0, 0.8]), top_p=0.9, seed=seed,
        max_tokens=max_tokens, ignore_eos=rng.random() < 0.7,
        stop=[rng.choice(["e", " the", "\n", "."])] if kind == "stop" else None,
        output_kind=RequestOutputKind.FINAL_ONLY if best_of else kind_out,
    )  # fmt: skip
    if kind in ("text", "stop"):
        words = ("the", "paged", "attention", "design", "stores", "key", "value", "blocks")
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
        return engine.generate(text, params, request_id=rid)
    return engine.generate(ids, params, request_id=rid)


async def _drive(engine: Any, stream: Any, fate: str, rng: random.Random) -> int:
    """Play one fate on a stream; returns the output tokens seen."""
    if fate == "keep":
        out = await stream
        return sum(len(c.token_ids) for c in out.outputs)
    if fate == "cancel":
        with anyio.move_on_after(rng.uniform(0.0, 0.3)):
            await stream
        return 0
    if fate == "abort":
        await anyio.sleep(rng.uniform(0.0, 0.2))
        await engine.abort(stream.request_id)
        out = await stream
        return sum(len(c.token_ids) for c in out.outputs)
    if fate == "drop":
        if rng.random() < 0.5:
            async for _ in stream:
                break  # no aclose: the dropped stream's finalizer aborts it
        return 0
    async for _ in stream:  # close midway
        if rng.random() < 0.3:
            break
    await stream.aclose()
    return 0


async def _client(engine: Any, state: SoakState, seed: int, index: int) -> None:
    from asyncpaged import InvalidRequestError

    rng = random.Random(seed * 1000 + index)
    count = 0
    while time.monotonic() < state.deadline:
        kind, fate = rng.choice(KINDS), rng.choice(FATES)
        rid = f"c{index}-{count}"
        count += 1
        state.num_requests += 1
        try:
            stream = _request(engine, rng, kind, rid)
        except InvalidRequestError:
            state.outcomes["refused" if kind == "invalid" else f"refused-{kind}"] += 1
            if kind != "invalid":
                state.errors[f"refused a valid {kind} request"] += 1
            continue
        if kind == "invalid":
            state.errors["accepted an invalid request"] += 1
        try:
            num_tokens = await _drive(engine, stream, fate, rng)
            state.num_tokens += num_tokens  # after the await: no update is lost
            state.outcomes[f"{kind}/{fate}"] += 1
        except Exception as exc:  # counted and reported: the soak goes on
            state.errors[f"{kind}/{fate}: {type(exc).__name__}: {exc}"[:200]] += 1
        del stream


async def _soak(args: argparse.Namespace) -> dict[str, Any]:
    from asyncpaged import AsyncEngine, EngineConfig
    from asyncpaged.tools.demo import default_model

    config = EngineConfig(
        model=args.model or default_model(), num_device_blocks=args.num_device_blocks,
        preemption_mode="swap", max_num_seqs=args.max_num_seqs, seed=args.seed,
        gc_freeze=args.gc_freeze,
    )  # fmt: skip
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    async with AsyncEngine(config) as engine:
        now = time.monotonic()
        state = SoakState(started=now, deadline=now + seconds)
        state.gc_freeze_count = gc.get_freeze_count()
        timer = _gc_timer(state)
        gc.callbacks.append(timer)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_probe, state)
                tg.start_soon(_sample_rss, state, engine, args.rss_every_s, args.progress)
                for i in range(args.concurrency):
                    tg.start_soon(_client, engine, state, args.seed, i)
            with anyio.fail_after(120):
                await engine.wait_idle()
        finally:
            gc.callbacks.remove(timer)
        state.rss.append((time.monotonic() - state.started, sum(engine_rss_mib(engine))))
        state.runner_rss_mib = engine_rss_mib(engine)[1]
        stats = engine.statistics()
    return _report(args, config, state, stats, seconds)


def _report(
    args: argparse.Namespace, config: Any, state: SoakState, stats: Any, seconds: float
) -> dict[str, Any]:
    leaked_device = stats.num_device_blocks - stats.num_free_device_blocks
    leaked_host = stats.num_host_blocks - stats.num_free_host_blocks
    warm = [m for t, m in state.rss if t >= args.warmup_frac * seconds] or [state.rss[-1][1]]
    growth = (warm[-1] - warm[0]) / warm[0]
    pauses = {f"gen{g}": {"count": d.count, "max_ms": d.max_s * 1e3,
                          "p99_ms": d.percentile(0.99) * 1e3}
              for g, d in state.gc_pauses.items()}  # fmt: skip
    lags = state.lags
    return {
        "seconds": seconds, "concurrency": args.concurrency, "gc_freeze": config.gc_freeze,
        "num_device_blocks": stats.num_device_blocks, "num_host_blocks": stats.num_host_blocks,
        "max_num_seqs": config.max_num_seqs, "num_requests": state.num_requests,
        "num_output_tokens": state.num_tokens,
        "rss_mib": [(round(t, 1), round(m, 1)) for t, m in state.rss],
        "rss_growth_after_warmup": growth,
        "runner_rss_mib": round(state.runner_rss_mib, 1),  # of the last sample; 0: no process
        "lag_ms": {"p50": lags.percentile(0.5) * 1e3, "p99": lags.percentile(0.99) * 1e3,
                   "max": lags.max_s * 1e3, "samples": lags.count},
        "gc_pauses": pauses, "gc_freeze_count": state.gc_freeze_count,
        "leaked_device_blocks": leaked_device, "leaked_host_blocks": leaked_host,
        "requests_left": stats.num_running + stats.num_waiting + stats.num_swapped,
        "num_unexpected_errors": sum(state.errors.values()), "errors": dict(state.errors),
        "outcomes": dict(sorted(state.outcomes.items())),
        "engine": {"num_finished": stats.num_finished, "num_aborted": stats.num_aborted,
                   "num_preemptions": stats.num_preemptions, "num_swap_outs": stats.num_swap_outs,
                   "num_swap_ins": stats.num_swap_ins, "num_recomputes": stats.num_recomputes,
                   "num_steps": stats.num_steps},
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    report = anyio.run(_soak, args)
    lag = report["lag_ms"]
    print(f"soak {report['seconds']:.0f} s: {report['num_requests']} requests, "
          f"{report['num_output_tokens']} tokens read; rss {report['rss_mib'][0][1]:.1f} -> "
          f"{report['rss_mib'][-1][1]:.1f} MiB (growth after warm-up "
          f"{report['rss_growth_after_warmup'] * 100:+.2f}%); loop lag p50 {lag['p50']:.2f} ms, "
          f"p99 {lag['p99']:.2f} ms, max {lag['max']:.1f} ms; gen-2 GC max "
          f"{report['gc_pauses']['gen2']['max_ms']:.1f} ms; leaked blocks "
          f"{report['leaked_device_blocks']} device / {report['leaked_host_blocks']} host; "
          f"unexpected errors {report['num_unexpected_errors']}")  # fmt: skip
    for error, count in report["errors"].items():
        print(f"  {count} x {error}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    ok = not (report["leaked_device_blocks"] or report["leaked_host_blocks"]
              or report["requests_left"] or report["num_unexpected_errors"])  # fmt: skip
    flat = report["rss_growth_after_warmup"] <= args.max_rss_growth
    if not flat:
        print(f"RSS grew more than --max-rss-growth ({args.max_rss_growth * 100:.1f}%)")
    return 0 if ok and flat else 1


def add_parser(modes: Any) -> None:
    p = modes.add_parser("soak", help="mixed hostile load for N minutes: RSS, leaks, loop lag")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--concurrency", type=int, default=24, help="client tasks")
    p.add_argument("--num-device-blocks", type=int, default=48, help="small: memory pressure")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--rss-every-s", type=float, default=10.0)
    p.add_argument("--warmup-frac", type=float, default=0.2, help="RSS growth measured after")
    p.add_argument("--max-rss-growth", type=float, default=0.02, help="else exit status 1")
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false")
    p.add_argument("--model", default=None, help="default: the built-in model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench-results", help="folder for soak.json")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)
