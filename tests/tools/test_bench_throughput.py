"""``asyncpaged bench throughput`` end to end on the quick workload, in real worker processes."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from asyncpaged.tools import bench_throughput
from asyncpaged.tools.bench_engines import EngineRun, WorkerSpec, engine_settings, run_one
from asyncpaged.tools.bench_throughput import check_runs, compare_tokens, summarize
from asyncpaged.tools.bench_workload import make_workload

ENGINES = ("asyncpaged", "hf-single", "hf-static-8", "hf-cb")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_throughput.add_parser(parser.add_subparsers(dest="mode", required=True))
    return parser.parse_args(["throughput", *argv])


def test_compare_tokens_reports_the_first_difference() -> None:
    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert compare_tokens(ref, ref).is_match
    check = compare_tokens(ref, [[1, 2, 3], [4, 9, 6], [7]])
    assert (check.num_mismatched, check.first_request, check.first_position) == (2, 1, 1)
    assert (check.expected, check.got) == (5, 9)
    short = compare_tokens(ref, [[1, 2, 3], [4, 5, 6]])
    assert (short.first_request, short.first_position, short.expected) == (2, 0, 7)
    assert short.got is None


def test_engines_option_rejects_unknown_names() -> None:
    assert parse(["--engines", "hf-cb, asyncpaged"]).engines == ["hf-cb", "asyncpaged"]
    with pytest.raises(SystemExit):
        parse(["--engines", "asyncpaged,vllm"])


def test_engine_options_are_config_fields_with_json_values() -> None:
    args = parse(["--engine-option", "screened_lm_head=false", "--engine-option",
                  "attention_backend=torch", "--engine-option", "max_num_seqs=3"])  # fmt: skip
    assert dict(args.engine_option) == {
        "screened_lm_head": False, "attention_backend": "torch", "max_num_seqs": 3,
    }  # fmt: skip
    for bad in ("no_such_field=1", "screened_lm_head"):
        with pytest.raises(SystemExit):
            parse(["--engine-option", bad])
    spec = WorkerSpec(engine="asyncpaged", model_dir="m", quick=True, num_requests=None,
                      threads=1, engine_options={"packed_linears": False})  # fmt: skip
    assert WorkerSpec.from_json(spec.to_json()) == spec  # travels to the worker intact
    # An option may override the bench's own settings (the bf16 comparison sets dtype).
    workload = make_workload(quick=True, num_requests=2)
    bf16 = dataclasses.replace(spec, engine_options={"dtype": "bfloat16", "max_num_seqs": 3})
    settings = engine_settings(bf16, workload)
    assert (settings["dtype"], settings["max_num_seqs"]) == ("bfloat16", 3)
    assert engine_settings(spec, workload)["dtype"] == "float32"
    assert settings["num_device_blocks"] == engine_settings(spec, workload)["num_device_blocks"]


def test_a_failed_worker_is_reported_not_raised(tmp_path: Path) -> None:
    spec = WorkerSpec(engine="no-such-engine", model_dir=str(tmp_path), quick=True,
                      num_requests=2, threads=1, progress=False)  # fmt: skip
    with capture_logs() as logs:
        failed = run_one(spec, repeat=0)
    assert failed.error == "worker exited with status 1"
    assert [e["event"] for e in logs] == ["bench_worker_failed"]
    ok = EngineRun(engine="hf-single", repeat=0, tokens=((1, 2),), wall_s=1.0, setup_s=1.0)
    summary = summarize(make_workload(quick=True, num_requests=1), [ok, failed], {}, {})
    assert summary["all_matched"] is False
    assert summary["medians"]["no-such-engine"]["num_runs"] == 0
    text = bench_throughput.format_table(summary)
    assert any(ln.split() == ["no-such-engine", "auto", "failed"] for ln in text.splitlines())
    assert "no-such-engine (repeat 0): worker exited with status 1" in text
    # Without the reference engine nothing is checked, and the report says so (not "NO").
    alone = EngineRun(engine="asyncpaged", repeat=0, tokens=((1, 2),), wall_s=1.0, setup_s=1.0)
    unchecked = summarize(make_workload(quick=True, num_requests=1), [alone], {}, {})
    assert unchecked["all_matched"] is None
    assert "tokens not checked: hf-single did not run" in bench_throughput.format_table(unchecked)


def test_a_quantized_kv_cache_is_a_column_and_its_tokens_are_not_checked() -> None:
    """An int8 KV cache rounds K and V: its tokens are not compared with hf-single's unquantized
    cache (the tests compare them with the rounding reference); the table names the KV dtype."""
    ref = EngineRun(engine="hf-single", repeat=0, tokens=((1, 2),), wall_s=1.0, setup_s=1.0)
    ours = EngineRun(engine="asyncpaged", repeat=0, tokens=((1, 3),), wall_s=0.5, setup_s=1.0)
    settings = {"engine_options": {"kv_cache_dtype": "int8"}}
    summary = summarize(make_workload(quick=True, num_requests=1), [ref, ours], settings, {})
    assert summary["all_matched"] is True
    assert summary["medians"]["asyncpaged"]["match"] is None
    assert summary["medians"]["asyncpaged"]["kv_cache_dtype"] == "int8"
    text = bench_throughput.format_table(summary)
    assert any(ln.split()[:2] == ["asyncpaged", "int8"] for ln in text.splitlines())
    assert "asyncpaged: tokens not checked (a quantized KV cache rounds K and V)" in text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_workload_all_engines_match_and_a_planted_mismatch_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = f"--quick --num-requests 6 --engines {','.join(ENGINES)} --no-progress".split()
    argv += ["--output", str(tmp_path / "out"), "--model-dir", str(tmp_path / "model")]
    assert bench_throughput.run(parse(argv)) == 0
    table = capsys.readouterr().out
    assert "all tokens match hf-single: yes" in table
    summary: dict[str, Any] = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert summary["workload"]["name"] == "quick"
    assert summary["workload"]["num_requests"] == 6
    assert {"cpu_model", "torch", "transformers"} <= set(summary["machine"])
    assert summary["settings"]["threads"] == 1
    assert summary["all_matched"] is True
    assert list(summary["medians"]) == list(ENGINES)
    runs = summary["runs"]
    assert [r["engine"] for r in runs] == list(ENGINES)
    for r in runs:
        assert r["error"] is None
        assert r["match"] is True
        assert r["threads"] == 1
        assert r["wall_s"] > 0 and r["setup_s"] > 0 and r["peak_rss_mib"] > 50
        assert [len(t) for t in r["tokens"]] == summary["workload"]["max_tokens"]
    for m in summary["medians"].values():
        assert m["num_runs"] == 1 and m["match"] is True and m["tok_per_s"] > 0
    (profile,) = [r["profile"] for r in runs if r["engine"] == "asyncpaged"]
    assert 0 < profile["compute_s"] < profile["step_s"] < runs[0]["wall_s"]
    assert profile["num_steps"] >= max(summary["workload"]["max_tokens"])
    assert "asyncpaged profile (" in table and "outside the model compute" in table
    names = {t["name"] for t in summary["targets"]}
    assert names == {"asyncpaged / hf-cb tok/s", "asyncpaged setup s"}  # no hf-static-64 here
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 0

    # Plant one wrong token in hf-cb's output: the comparison must find it, and the summary say so.
    engine_runs = [EngineRun.from_worker(r["repeat"], r) for r in runs]
    cb = engine_runs[-1]
    bad = [list(t) for t in cb.tokens]
    bad[3][5] += 1
    engine_runs[-1] = EngineRun.from_worker(0, {**runs[-1], "tokens": bad})
    check = check_runs(engine_runs)[("hf-cb", 0)]
    assert check is not None and not check.is_match
    assert (check.num_mismatched, check.first_request, check.first_position) == (1, 3, 5)
    assert check.got == check.expected + 1  # type: ignore[operator]
    planted = summarize(make_workload(quick=True, num_requests=6), engine_runs, {}, {})
    assert planted["all_matched"] is False
    assert planted["medians"]["hf-cb"]["match"] is False
    assert planted["medians"]["asyncpaged"]["match"] is True
    text = bench_throughput.format_table(planted)
    assert "hf-cb (repeat 0): 1/6 requests differ; first: request 3 position 5" in text
    assert "all tokens match hf-single: NO" in text
