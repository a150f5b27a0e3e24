"""``asyncpaged bench speculative`` on a small run: every mode's greedy tokens agree."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncpaged.tools.bench_speculative import grounded_prompts, run


def test_grounded_prompts_repeat_their_passage() -> None:
    prompts = grounded_prompts(3)
    assert len(prompts) == 3
    for p in prompts:
        passage, blank, echo = p[:700], p[700:702], p[702:]
        assert blank == "\n\n"
        assert passage.startswith(echo)  # the passage's beginning, again at the end ...
        assert 100 < len(echo) <= 160
        assert passage[len(echo)] in " \n"  # ... cut where a word ends


def test_bench_speculative_small_run(tmp_path: Path) -> None:
    args = argparse.Namespace(
        modes=["off", "ngram"], model=None, draft_model=None, k=3, lookup_min=1, lookup_max=3,
        num_prompts=2, max_tokens=12, batches=[1, 2], throughput_batch=4, repeats=1, threads=1,
        executor_backend="thread",
        output=str(tmp_path),
    )  # fmt: skip
    assert run(args) == 0  # greedy tokens identical in both modes
    report = json.loads((tmp_path / "speculative.json").read_text())
    for mode in ("off", "ngram"):
        row = report["summary"][mode]
        for key in ("batch_1", "batch_2", "batch_4"):
            assert row[key]["tpot_ms"] > 0.0
            assert row[key]["tokens_per_s"] > 0.0
    assert report["summary"]["off"]["tokens_per_round"] == 1.0
