"""``asyncpaged bench soak`` end to end for a few seconds: JSON written, no leak, no error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncpaged.tools import bench_soak
from asyncpaged.tools.bench_soak import percentile


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_soak.add_parser(parser.add_subparsers(dest="mode", required=True))
    return parser.parse_args(["soak", *argv])


def test_percentile() -> None:
    assert percentile([], 0.99) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(map(float, range(101))), 0.99) == 99.0


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
