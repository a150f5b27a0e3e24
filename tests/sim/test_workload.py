"""Synthetic traces: the paper's mean lengths and Poisson arrivals."""

from __future__ import annotations

import itertools
import statistics

import pytest

from asyncpaged.sim.workload import WorkloadSpec, generate


@pytest.mark.parametrize(
    ("name", "mean_in", "mean_out"), [("sharegpt", 161, 338), ("alpaca", 19, 58)]
)
def test_mean_lengths_are_the_papers(name: str, mean_in: int, mean_out: int) -> None:
    trace = generate(WorkloadSpec(distribution=name, num_requests=20000, seed=1))
    assert statistics.fmean(r.prompt_len for r in trace) == pytest.approx(mean_in, rel=0.08)
    assert statistics.fmean(r.output_len for r in trace) == pytest.approx(mean_out, rel=0.08)
    assert all(r.prompt_len + r.output_len <= 2048 and r.output_len >= 1 for r in trace)
    assert all(r.arrival_s == 0.0 for r in trace)


def test_poisson_arrivals_at_the_rate() -> None:
    trace = generate(WorkloadSpec(num_requests=20000, rate=4.0, seed=2))
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd == mean


def test_shared_prefix_is_in_every_prompt_and_specs_are_checked() -> None:
    trace = generate(WorkloadSpec(num_requests=100, shared_prefix_len=500, n=2))
    assert all(r.prompt_len > 500 and r.prompt_len + r.output_len <= 2048 for r in trace)
    assert {r.n for r in trace} == {2}
    with pytest.raises(ValueError, match="not both"):
        WorkloadSpec(n=2, beam_width=2)
    with pytest.raises(ValueError, match="distribution"):
        WorkloadSpec(distribution="lmsys")
