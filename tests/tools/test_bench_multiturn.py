"""``asyncpaged bench multiturn`` end to end on a small run: the three tier modes, the tiers
serving evicted history, identical tokens, JSON written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asyncpaged.tools.bench_multiturn import run


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_bench_multiturn_small_run(backend: str, tmp_path: Path) -> None:
    args = argparse.Namespace(
        users=6, turns=3, concurrency=2, system_tokens=16, context_tokens=64, message_tokens=16,
        max_tokens=8, device_blocks=20, host_blocks=64, small_host_blocks=2, repeats=1,
        warmup=0, threads=1, seed=0, output=str(tmp_path), progress=False,
        executor_backend=backend,
    )  # fmt: skip
    assert run(args) == 0  # tokens identical across the modes
    report = json.loads((tmp_path / "multiturn.json").read_text())
    assert [r["mode"] for r in report["runs"]] == ["off", "host", "host+disk"]
    off, host, disk = (report["summary"][m] for m in ("off", "host", "host+disk"))
    assert off["hit_tokens"]["host"] == off["hit_tokens"]["disk"] == 0
    assert host["hit_tokens"]["host"] > 0
    assert disk["hit_tokens"]["disk"] > 0
    # the tiers serve history the small device pool evicted: less prompt to compute
    assert host["computed_prompt_tokens"] < off["computed_prompt_tokens"]
    assert disk["computed_prompt_tokens"] < off["computed_prompt_tokens"]
    assert report["tokens_identical"]
