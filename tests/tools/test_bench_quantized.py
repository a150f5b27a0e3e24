"""``asyncpaged bench quantized`` runs end to end on a tiny shape and writes its report; the
parser of llama-batched-bench's table reads the batched decode speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from asyncpaged.tools.bench_quantized import _batched_tg

BATCHED_BENCH = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     3 |     64 |   16 |   1072 |    0.052 |   916.74 |    3.120 |   328.21 |    3.172 |   337.95 |
"""


def test_the_batched_table_is_parsed() -> None:
    assert _batched_tg(BATCHED_BENCH) == 328.21


def test_bench_quantized_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncpaged", "bench", "quantized", "--shape", "tiny",
         "--types", "Q8_0", "--rounds", "1", "--new-tokens", "4", "--batch", "2",
         "--prompt-tokens", "16", "--files", str(tmp_path / "files"),
         "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "asyncpaged Q8_0" in done.stdout
    report = json.loads((tmp_path / "out" / "quantized.json").read_text())
    assert set(report["medians"]) == {"asyncpaged Q8_0"}
    assert all(v["decode"] > 0 for v in report["medians"].values())
