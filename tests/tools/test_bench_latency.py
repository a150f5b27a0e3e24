"""``asyncpaged bench latency``: vLLM's metric definitions on a hand-built timeline, and a short
run of the quick workload end to end (JSON fields, consistency, PNG)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from asyncpaged.tools import bench_latency
from asyncpaged.tools.bench_latency import (
    RequestTimeline,
    arrival_offsets,
    compute_metrics,
    parse_rates,
    percentile,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_latency.add_parser(parser.add_subparsers(dest="mode", required=True))
    return parser.parse_args(["latency", *argv])


def test_metrics_of_a_known_timeline() -> None:
    # Sent at 10.0; chunks at 10.5, 10.6, 10.8 (the last one carrying 2 tokens): 4 tokens.
    a = RequestTimeline(send_s=10.0, chunk_s=(10.5, 10.6, 10.8), num_prompt_tokens=7,
                        num_output_tokens=4)  # fmt: skip
    # A single-token request: it has a TTFT and an E2E latency but neither TPOT nor ITL.
    b = RequestTimeline(send_s=11.0, chunk_s=(11.2,), num_prompt_tokens=3, num_output_tokens=1)
    assert a.ttft_s == pytest.approx(0.5)
    assert a.e2e_s == pytest.approx(0.8)
    assert a.tpot_s == pytest.approx((0.8 - 0.5) / 3)  # excludes the first token
    assert a.itls_s == pytest.approx([0.1, 0.2])  # per chunk, not per token
    assert b.tpot_s is None
    assert b.itls_s == []

    r = compute_metrics([a, b], duration_s=2.0, request_rate=4.0, num_preemptions=1)
    assert (r.num_requests, r.total_input_tokens, r.total_output_tokens) == (2, 10, 5)
    assert (r.num_chunks, r.num_itls) == (4, 2)
    assert r.request_throughput == pytest.approx(1.0)
    assert r.output_throughput == pytest.approx(2.5)
    assert r.ttft.mean_ms == pytest.approx(350.0)
    assert r.ttft.median_ms == pytest.approx(350.0)
    assert r.ttft.p99_ms == pytest.approx(200 + 0.99 * 300)  # linear between the two
    assert r.tpot.mean_ms == r.tpot.median_ms == r.tpot.p99_ms == pytest.approx(100.0)
    assert r.itl.mean_ms == pytest.approx(150.0)
    assert r.e2e.mean_ms == pytest.approx(500.0)
    assert r.to_json()["request_rate"] == "4"


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 0) == 1.0
    assert percentile([7.0], 99) == 7.0


def test_no_tpot_samples_summarize_to_zero() -> None:
    one = RequestTimeline(send_s=0.0, chunk_s=(0.1,), num_prompt_tokens=1, num_output_tokens=1)
    r = compute_metrics([one], duration_s=1.0, request_rate=math.inf)
    assert (r.tpot.mean_ms, r.itl.p99_ms) == (0.0, 0.0)
    assert r.to_json()["request_rate"] == "inf"


def test_arrivals_are_seeded_poisson_and_inf_is_all_at_once() -> None:
    slow = arrival_offsets(2000, 2.0, seed=3)
    assert slow == arrival_offsets(2000, 2.0, seed=3)
    assert slow[0] == 0.0
    assert slow == sorted(slow)
    assert slow[-1] / len(slow) == pytest.approx(0.5, rel=0.1)  # mean gap 1 / rate
    fast = arrival_offsets(2000, 4.0, seed=3)
    assert fast == pytest.approx([t / 2 for t in slow])  # the same draws, scaled
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_rates_are_parsed_and_checked() -> None:
    assert parse_rates("0.5,1,inf") == [0.5, 1.0, math.inf]
    for bad in ("0,1", "-1", "nan", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)


def test_quick_run_writes_consistent_json_and_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse(["--quick", "--rates", "20,inf", "--num-requests", "4", "--no-progress",
                   "--output", str(tmp_path / "out"),
                   "--checkpoint-dir", str(tmp_path / "model")])  # fmt: skip
    assert bench_latency.run(args) == 0
    assert "TTFT ms" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "latency.json").read_text())
    assert report["threads"] == 1
    assert [r["request_rate"] for r in report["results"]] == ["20", "inf"]
    for r in report["results"]:
        assert r["num_requests"] == 4
        assert r["num_itls"] == r["num_chunks"] - r["num_requests"]
        assert r["num_chunks"] <= r["total_output_tokens"]
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2e"):
            s = r[metric]
            assert 0 <= s["median_ms"] <= s["p99_ms"], metric
            assert s["mean_ms"] >= 0, metric
        assert r["ttft"]["mean_ms"] <= r["e2e"]["mean_ms"]
        assert r["ttft"]["p99_ms"] <= r["e2e"]["p99_ms"]
        assert r["e2e"]["p99_ms"] <= 1000 * r["duration_s"]
    assert (tmp_path / "out" / "latency.png").stat().st_size > 10_000
