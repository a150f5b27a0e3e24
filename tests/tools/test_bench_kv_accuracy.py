"""``asyncpaged bench kv-accuracy``: the measurement on a tiny model, with loose bounds."""

from __future__ import annotations

from pathlib import Path

from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from asyncpaged.tools.bench_kv_accuracy import _load, format_table, measure
from tests.engine.test_engine import make_prompts


def test_int8_costs_less_than_fp8_against_the_unquantized_cache(tmp_path: Path) -> None:
    model = _load(build_tiny_checkpoint("llama-gqa", tmp_path))
    prompts = make_prompts(4, seed=5)
    results = measure(model, "llama-gqa", prompts, 8, ["int8", "fp8_e4m3", "fp8_e5m2"])
    kl = {r.kv_cache_dtype: r.mean_kl for r in results}
    assert 0 < kl["int8"] < kl["fp8_e4m3"] < kl["fp8_e5m2"] < 1.0, kl
    for r in results:
        assert r.num_positions == 4 * 8 and r.num_prompts == 4
        assert 0 <= r.greedy_agreement <= r.top1_agreement <= 1, r
        assert 0 <= r.same_sequences <= 1
    by_dtype = {r.kv_cache_dtype: r for r in results}
    assert by_dtype["int8"].top1_agreement >= 0.8, by_dtype["int8"]
    assert "int8" in format_table(results)
