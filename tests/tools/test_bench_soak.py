"""``asyncpaged bench soak`` end to end for a few seconds: JSON written, no leak, no error."""

from __future__ import annotations

import argparse
import json
import random
import tracemalloc
from pathlib import Path

from asyncpaged.tools import bench_soak
from asyncpaged.tools.bench_soak import Durations, percentile


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_soak.add_parser(parser.add_subparsers(dest="mode", required=True))
    return parser.parse_args(["soak", *argv])


def test_percentile() -> None:
    assert percentile([], 0.99) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(map(float, range(101))), 0.99) == 99.0


def test_durations_percentiles_within_a_percent() -> None:
    rng = random.Random(0)
    values = [rng.lognormvariate(-7, 1.5) for _ in range(20000)] + [0.0, 3e-7, 250.0]
    durations = Durations()
    for v in values:
        durations.record(v)
    assert durations.count == sum(durations.counts) == len(values)
    assert durations.max_s == max(values)
    for q in (0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0):
        exact = percentile(values, q)
        got = durations.percentile(q)
        assert exact <= got <= max(exact * 1.0101, Durations.MIN_S), (q, exact, got)
    assert Durations().percentile(0.5) == 0.0


def test_durations_record_allocates_nothing_that_stays() -> None:
    durations = Durations()
    durations.record(1e-3)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(50000):
            durations.record(1e-4 * (1 + i % 977))
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 4096  # a list of the samples would hold ~1.6 MB


def test_soak_short_run(tmp_path: Path) -> None:
    args = _parse(["--seconds", "4", "--concurrency", "8", "--rss-every-s", "1",
                   "--output", str(tmp_path), "--no-progress",
                   "--max-rss-growth", "100"])  # a few seconds are all warm-up  # fmt: skip
    assert args.minutes == 30.0 and args.gc_freeze
    assert bench_soak.run(args) == 0
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["leaked_device_blocks"] == report["leaked_host_blocks"] == 0
    assert report["requests_left"] == 0 and report["num_unexpected_errors"] == 0
    assert report["num_requests"] > 8 and report["outcomes"]
    assert report["lag_ms"]["samples"] > 10
    assert report["lag_ms"]["p50"] <= report["lag_ms"]["p99"] <= report["lag_ms"]["max"]
    assert len(report["rss_mib"]) >= 2 and report["gc_freeze_count"] > 0
