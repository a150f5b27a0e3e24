"""``asyncpaged bench structured`` end to end on a small run: the three modes, JSON written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncpaged.tools.bench_structured import run


def test_bench_structured_small_run(tmp_path: Path) -> None:
    args = argparse.Namespace(num_requests=3, max_tokens=140, repeats=1, seed=0,
                              output=str(tmp_path), progress=False, engine_option=[])  # fmt: skip
    assert run(args) == 0  # every finished constrained output parses
    report = json.loads((tmp_path / "structured.json").read_text())
    assert [r["mode"] for r in report["runs"]] == ["free", "json", "json_jf"]
    free, bound, jumped = report["runs"]
    assert free["tokens"] == 3 * 140  # EOS ignored: every request makes max_tokens
    for r in (bound, jumped):
        assert r["num_stopped"] == r["num_valid_json"] > 0
    # jump-forward appends the schema's keys without sampling: far fewer steps
    assert bound["num_jump_forward_tokens"] == 0 < jumped["num_jump_forward_tokens"]
    assert jumped["num_steps"] * 3 < bound["num_steps"]
    assert report["same_json"]
    assert set(report["ratios"]) >= {"json_vs_free", "jump_forward_on_vs_off"}
    assert report["ratio"] > 0
