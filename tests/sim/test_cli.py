"""``asyncpaged simulate``: the table, the JSON and the plots of a small sweep."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asyncpaged.tools import simulate


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate.add_parser(parser.add_subparsers())
    return parser.parse_args(["simulate", *argv])


def test_a_small_sweep_prints_writes_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.json"
    args = parse(
        [
            "--distribution",
            "alpaca",
            "--num-requests",
            "40",
            "--rates",
            "2,50",
            "--systems",
            "paged,orca-max",
            "--json",
            str(out),
            "--plot-prefix",
            str(tmp_path / "sim"),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "989 KV blocks of 16 tokens (15824 tokens, 800 KiB each)" in text
    rows = json.loads(out.read_text())
    assert [(r["system"], r["rate"]) for r in rows] == [
        ("paged", 2.0),
        ("paged", 50.0),
        ("orca-max", 2.0),
        ("orca-max", 50.0),
    ]
    assert all(r["num_requests"] == 40 and r["timeline"] for r in rows)
    assert (tmp_path / "sim_latency.png").stat().st_size > 0
    assert (tmp_path / "sim_utilization.png").stat().st_size > 0
    assert (tmp_path / "sim_batch.png").stat().st_size > 0
