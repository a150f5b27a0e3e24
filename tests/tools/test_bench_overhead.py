"""``asyncpaged bench overhead`` on a small run: every sequence decoded, the numbers consistent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asyncpaged.tools.bench_overhead import run


@pytest.mark.parametrize(
    ("mode", "executor", "ahead"),
    [("greedy", "thread", False), ("sampled", "thread", False), ("penalized", "thread", False),
     ("greedy", "process", False), ("greedy", "thread", True), ("greedy", "process", True),
     ("bad_words", "process", True)],
)  # fmt: skip
def test_bench_overhead_small_run(tmp_path: Path, mode: str, executor: str, ahead: bool) -> None:
    args = argparse.Namespace(num_seqs=16, max_tokens=12, repeats=2, threads=1,
                              sampled=mode == "sampled", penalized=mode == "penalized",
                              bad_words=mode == "bad_words",
                              executor_backend=executor, device="cpu", enforce_eager=False,
                              async_scheduling="on" if ahead else "off",
                              model_dir=str(tmp_path / "model"),
                              output=str(tmp_path))  # fmt: skip
    assert run(args) == 0  # the two runs' tokens agree (sampled: seeded per request)
    report = json.loads((tmp_path / "overhead.json").read_text())
    assert report["model"]["num_hidden_layers"] == 1
    for r in report["runs"]:
        # One step per token once every sequence is admitted (intake may spread the 16 over the
        # first steps; more of them with async scheduling, whose steps follow closer).
        assert 12 <= r["steps"] <= 12 + (7 if ahead else 3)
        assert 0.0 < r["outside_forward"] < 1.0
        assert r["ms_per_step"] > 0.0
        assert 0.0 < r["loop_cpu_ms_per_step"] <= r["ms_per_step"] * 1.05
        assert 0.0 < r["forward_ms_per_step"] < r["ms_per_step"]
        assert (r["steps_planned_ahead"] > r["steps"] // 2) == ahead
        assert r["cuda_graph_replays"] == 0  # a CPU
