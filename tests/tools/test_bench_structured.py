"""``asyncpaged bench structured`` end to end on a small run: both modes, JSON written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncpaged.tools.bench_structured import run


def test_bench_structured_small_run(tmp_path: Path) -> None:
    args = argparse.Namespace(num_requests=3, max_tokens=140, repeats=1, seed=0,
                              output=str(tmp_path), progress=False)  # fmt: skip
    assert run(args) == 0  # every finished constrained output parses
    report = json.loads((tmp_path / "structured.json").read_text())
    modes = [r["constrained"] for r in report["runs"]]
    assert modes == [False, True]
    free, bound = report["runs"]
    assert free["tokens"] == 3 * 140  # EOS ignored: every request makes max_tokens
    assert bound["num_stopped"] == bound["num_valid_json"] > 0
    assert report["ratio"] > 0
