"""``asyncpaged bench memory``: paged utilization beats every reservation policy, the series cover
every step, and the command writes its JSON and PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asyncpaged.tools import bench_memory
from asyncpaged.tools.bench_memory import bucket_means, run_policy
from asyncpaged.tools.waste_report import ALLOCATORS, SHAREGPT, StepSample, simulate

SMALL = {"num_requests": 120, "budget_tokens": 4096, "max_model_len": 1024, "seed": 0}


def test_bucket_means_average_consecutive_steps() -> None:
    assert bucket_means([1.0, 2.0, 3.0, 4.0, 5.0], 2) == ([1, 3], [1.5, 4.0])
    assert bucket_means([1.0, 2.0, 3.0], 10) == ([1, 2, 3], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="max_points must be at least 1"):
        bucket_means([1.0], 0)


def test_trace_has_every_step_and_leaves_the_result_unchanged() -> None:
    trace: list[StepSample] = []
    traced = simulate(SHAREGPT, "paged", **SMALL, trace=trace)
    assert traced == simulate(SHAREGPT, "paged", **SMALL)
    assert sum(1 for s in trace if s.num_waiting) == traced.num_steps  # the contended steps
    assert trace[-1].num_waiting == 0
    assert all(0 < s.num_tokens <= s.num_reserved_slots <= 4096 for s in trace)
    assert max(s.num_running for s in trace) == traced.concurrent_max


def test_series_cover_the_run_at_full_or_bucketed_resolution() -> None:
    full = run_policy(SHAREGPT, "reserve-pow2", block_size=16, max_points=10**9, **SMALL)
    assert len(full.step) == len(full.utilization) == len(full.num_running)
    assert len(full.step) == full.num_steps_total >= full.result.num_steps
    assert full.step == tuple(range(1, full.num_steps_total + 1))
    coarse = run_policy(SHAREGPT, "reserve-pow2", block_size=16, max_points=50, **SMALL)
    assert len(coarse.step) == len(coarse.utilization) == len(coarse.num_running) == 50
    assert coarse.step[0] == 1 and list(coarse.step) == sorted(coarse.step)
    mean_running = sum(full.num_running) / len(full.num_running)
    assert sum(coarse.num_running) / 50 == pytest.approx(mean_running, rel=0.05)


def test_memory_command_paged_beats_reservation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench_memory.add_parser(parser.add_subparsers(dest="mode", required=True))
    args = parser.parse_args(["memory", "--num-requests", "120", "--budget-tokens", "4096",
                              "--max-model-len", "1024", "--max-points", "100",
                              "--output", str(tmp_path)])  # fmt: skip
    assert bench_memory.run(args) == 0
    assert "steps to drain" in capsys.readouterr().out
    rows = json.loads((tmp_path / "memory.json").read_text())["results"]
    assert [(r["distribution"], r["allocator"]) for r in rows] == [
        (d, a) for d in ("sharegpt", "alpaca") for a in ALLOCATORS
    ]
    for dist in ("sharegpt", "alpaca"):
        paged, *reserved = [r for r in rows if r["distribution"] == dist]
        assert paged["allocator"] == "paged"
        for r in reserved:
            assert paged["utilization_mean"] > r["utilization_mean"], (dist, r["allocator"])
            assert paged["concurrent_mean"] > r["concurrent_mean"], (dist, r["allocator"])
            assert paged["num_steps_total"] < r["num_steps_total"], (dist, r["allocator"])
    for r in rows:
        series = r["series"]
        n = min(r["num_steps_total"], 100)
        assert len(series["step"]) == len(series["utilization"]) == len(series["num_running"]) == n
        assert all(0 < u <= 1 for u in series["utilization"])
    assert (tmp_path / "memory.png").stat().st_size > 10_000


def test_a_byte_budget_holds_twice_bfloat16s_blocks_in_int8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-cache-bytes: each KV dtype gets the blocks the engine would count (int8's scales
    included: 66 bytes per token and head against 128) and runs them; the peak of running
    sequences follows the blocks."""
    parser = argparse.ArgumentParser()
    bench_memory.add_parser(parser.add_subparsers(dest="mode", required=True))
    args = parser.parse_args(["memory", "--num-requests", "300", "--kv-cache-bytes", str(2**22),
                              "--kv-cache-dtypes", "bfloat16,int8", "--distributions", "alpaca",
                              "--max-model-len", "512", "--output", str(tmp_path)])  # fmt: skip
    assert bench_memory.run(args) == 0
    out = capsys.readouterr().out
    assert "blocks x bf16" in out
    rows = json.loads((tmp_path / "memory.json").read_text())["results"]
    paged = {r["kv_cache_dtype"]: r for r in rows if r["allocator"] == "paged"}
    # 6 layers x 2 KV heads x 16 tokens x K, V: 128 or 66 bytes per token and head
    assert paged["bfloat16"]["num_blocks"] == 2**22 // (6 * 2 * 16 * 2 * 128)
    assert paged["int8"]["num_blocks"] == 2**22 // (6 * 2 * 16 * 2 * 66)
    assert paged["int8"]["concurrent_max"] >= 1.9 * paged["bfloat16"]["concurrent_max"]
