"""Synthetic request traces: paper-like length distributions and Poisson arrivals.

Lengths come from :mod:`asyncpaged.tools.waste_report`'s log-normal distributions, whose means
are the vLLM paper's (ShareGPT: 161 input / 338 output tokens; Alpaca: 19 / 58), clipped so that
prompt and output fit ``max_model_len``. Arrivals are a Poisson process at ``rate`` requests per
second (``math.inf``: every request at time 0). A shared prefix of ``shared_prefix_len`` tokens
(a system prompt) is put in front of every prompt; parallel sampling ``n`` and beam width apply
to every request.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from asyncpaged.tools.waste_report import DISTRIBUTIONS, LengthDistribution


@dataclass(frozen=True, slots=True, kw_only=True)
class SimRequest:
    """One request of a trace. Invariant: ``prompt_len >= 1``, ``output_len >= 1``."""

    request_id: str
    arrival_s: float
    prompt_len: int  # the shared prefix included
    output_len: int  # tokens each output sequence generates
    n: int = 1  # parallel samples
    beam_width: int = 1  # > 1: beam search (``n`` must then be 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadSpec:
    """What to generate. Invariants: ``rate > 0``; ``n >= 1``; ``beam_width >= 1``; not both
    ``n > 1`` and ``beam_width > 1``."""

    distribution: str = "sharegpt"
    num_requests: int = 1000
    rate: float = math.inf  # requests per second
    n: int = 1
    beam_width: int = 1
    shared_prefix_len: int = 0
    max_model_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {sorted(DISTRIBUTIONS)}, got {self.distribution!r}."
            )
        if self.rate <= 0 or self.num_requests < 1 or self.n < 1 or self.beam_width < 1:
            raise ValueError(f"rate, num_requests, n and beam_width must be positive: {self}.")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError("use either parallel sampling (n > 1) or beam search, not both.")
        if not 0 <= self.shared_prefix_len < self.max_model_len - 1:
            raise ValueError(
                f"shared_prefix_len must be in [0, {self.max_model_len - 1}), "
                f"got {self.shared_prefix_len}."
            )


def generate(spec: WorkloadSpec) -> list[SimRequest]:
    """The trace, in arrival order; equal specs give equal traces."""
    rng = random.Random(spec.seed)
    dist: LengthDistribution = DISTRIBUTIONS[spec.distribution]
    room = spec.max_model_len - spec.shared_prefix_len
    t = 0.0
    out = []
    for i in range(spec.num_requests):
        if not math.isinf(spec.rate):
            t += rng.expovariate(spec.rate)
        n_in, n_out = dist.sample(rng, room)
        n_out = max(1, min(n_out, room - n_in))
        out.append(
            SimRequest(
                request_id=f"r{i}",
                arrival_s=0.0 if math.isinf(spec.rate) else t,
                prompt_len=spec.shared_prefix_len + n_in,
                output_len=n_out,
                n=spec.n,
                beam_width=spec.beam_width,
            )
        )
    return out
