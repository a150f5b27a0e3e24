"""Smoke tests of the waste report and the pool micro-benchmark on small inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncpaged.__main__ import main
from asyncpaged.tools.pool_bench import OPS, bench_pool
from asyncpaged.tools.waste_report import ALPACA, SHAREGPT, _Reservation, simulate


def test_sharegpt_paged_wastes_under_four_percent_and_beats_reservation() -> None:
    kwargs = {"num_requests": 300, "budget_tokens": 16384}
    paged = simulate(SHAREGPT, "paged", **kwargs)
    oracle = simulate(SHAREGPT, "reserve-oracle", **kwargs)
    pow2 = simulate(SHAREGPT, "reserve-pow2", **kwargs)
    rmax = simulate(SHAREGPT, "reserve-max", **kwargs)
    assert paged.utilization_mean >= 0.96
    assert paged.utilization_mean > oracle.utilization_mean > pow2.utilization_mean
    assert pow2.utilization_mean > rmax.utilization_mean
    assert 0.15 < rmax.utilization_mean < 0.45
    assert paged.concurrent_mean > 2 * rmax.concurrent_mean
    assert 120 < paged.mean_input_len < 200
    assert 280 < paged.mean_output_len < 400


def test_reservation_sizes_are_the_papers_max_pow2_and_oracle() -> None:
    # Pow2 over-reserves the output positions by at most 2x (the paper: 32 positions for a
    # 25-token output), never past max_model_len; the simulator charges the same
    # (tests/sim/test_simulator.py).
    sizes = {p: _Reservation(10**6, p, 2048).size(100, 25) for p in ("reserve-max",
             "reserve-pow2", "reserve-oracle")}  # fmt: skip
    assert sizes == {"reserve-max": 2048, "reserve-pow2": 100 + 32, "reserve-oracle": 125}
    assert _Reservation(10**6, "reserve-pow2", 2048).size(1500, 400) == 1500 + 512
    assert _Reservation(10**6, "reserve-pow2", 2048).size(1600, 400) == 2048  # capped
    assert _Reservation(10**6, "reserve-pow2", 2048).size(100, 32) == 132
    assert _Reservation(10**6, "reserve-pow2", 2048).size(100, 1) == 101


def test_alpaca_waste_is_bounded_by_half_a_block_per_sequence() -> None:
    result = simulate(ALPACA, "paged", num_requests=600, budget_tokens=4096, block_size=4)
    assert result.utilization_mean >= 0.96
    coarse = simulate(ALPACA, "paged", num_requests=600, budget_tokens=4096, block_size=16)
    assert 0.80 < coarse.utilization_mean < result.utilization_mean


def test_waste_report_command_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "waste.json"
    args = ["waste-report", "--num-requests", "100", "--budget-tokens", "8192"]
    assert main([*args, "--distributions", "sharegpt", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["allocator"] for r in rows] == [
        "paged", "reserve-max", "reserve-pow2", "reserve-oracle"
    ]  # fmt: skip
    assert "reserve-oracle" in capsys.readouterr().out


def test_pool_bench_times_every_operation() -> None:
    result = bench_pool(1000, num_ops=200)
    assert set(result) == set(OPS)
    assert all(0 < us < 10_000 for us in result.values())


def test_sharing_saves_memory_and_more_with_more_sequences() -> None:
    from asyncpaged.tools.sharing_report import beam_search_saving, parallel_sampling_saving

    two = parallel_sampling_saving(SHAREGPT, 2, num_requests=20)
    six = parallel_sampling_saving(SHAREGPT, 6, num_requests=20)
    assert 0.0 < two < six < 0.5
    beams = beam_search_saving(ALPACA, 4, num_requests=8)
    assert 0.2 < beams < 0.9


def test_demo_and_generate_commands(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from asyncpaged.testing.tiny_models import build_tiny_checkpoint

    model = str(build_tiny_checkpoint("llama-gqa", tmp_path / "m"))
    assert main(["demo", "--model", model, "--num-streams", "3", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(line[:3] for line in out if line.startswith("[")) == ["[0]", "[1]", "[2]"]
    assert out[-1].startswith("running 0  waiting 0  swapped 0")
    assert main(["generate", "--model", model, "The block", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("The block")
