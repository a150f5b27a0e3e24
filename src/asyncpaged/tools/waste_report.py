"""KV-cache waste: the paged pool against contiguous reservation, on paper-like workloads.

Requests with ShareGPT-like or Alpaca-like lengths are admitted first come, first served into a
fixed budget of KV slots and decoded one token per step (iteration-level batching), until all have
finished. Per step we record the tokens whose K/V are stored and the slots reserved for them:

* ``paged``: the real :class:`BlockPool`; a request takes blocks for its prompt
  on admission (if 1% of the pool stays free, vLLM's watermark) and one block whenever its last
  block fills. When a running sequence cannot get a block, the latest-admitted one is preempted
  (recompute: its blocks are freed, and it is requeued first with its tokens so far).
* ``reserve-max``: each request reserves ``max_model_len`` slots on admission (Orca Max).
* ``reserve-pow2``: its prompt plus the next power of two of its output length, at most
  ``max_model_len`` (Orca Pow2, as the paper defines it: outputs over-reserved by at most 2x, 32
  positions for a 25-token output; the simulator's rule too).
* ``reserve-oracle``: exactly its final length (Orca Oracle).

The baselines are charged only for reservation and internal fragmentation, never for external
fragmentation, which flatters them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from asyncpaged.kv.block_pool import BlockPool


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthDistribution:
    """Log-normal input and output lengths, clipped to [1, max_model_len] in total.

    The means are those the vLLM paper reports for its traces (ShareGPT: 161 in / 338 out;
    Alpaca: 19 in / 58 out); the spreads are our choice (ShareGPT's lengths vary far more).
    """

    name: str
    input_mean: float
    input_sigma: float
    output_mean: float
    output_sigma: float

    def sample(self, rng: random.Random, max_model_len: int) -> tuple[int, int]:
        n_in = _lognormal(rng, self.input_mean, self.input_sigma)
        n_in = min(n_in, max_model_len - 1)
        n_out = min(_lognormal(rng, self.output_mean, self.output_sigma), max_model_len - n_in)
        return n_in, n_out


SHAREGPT = LengthDistribution(
    name="sharegpt", input_mean=161, input_sigma=1.0, output_mean=338, output_sigma=0.9
)
ALPACA = LengthDistribution(
    name="alpaca", input_mean=19, input_sigma=0.6, output_mean=58, output_sigma=0.8
)
DISTRIBUTIONS = {d.name: d for d in (SHAREGPT, ALPACA)}
ALLOCATORS = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] == mean
    return max(1, round(rng.lognormvariate(mu, sigma)))


@dataclass(frozen=True, slots=True, kw_only=True)
class WasteResult:
    distribution: str
    allocator: str
    block_size: int
    budget_tokens: int
    num_requests: int
    mean_input_len: float
    mean_output_len: float
    utilization_mean: float  # tokens stored / slots reserved, averaged over steps
    utilization_at_peak: float  # the same at the step storing the most tokens
    utilization_min: float
    concurrent_mean: float
    concurrent_max: int
    num_steps: int
    num_preemptions: int


class StepSample(NamedTuple):
    """The cache after one step of :func:`simulate` (recorded when it is given a ``trace``)."""

    num_tokens: int  # tokens whose K/V are stored
    num_reserved_slots: int  # slots held for them (whole blocks, or whole reservations)
    num_running: int
    num_waiting: int


class _Reservation:
    """Contiguous per-request reservation of ``size(n_in, n_out)`` slots."""

    def __init__(self, budget: int, policy: str, max_model_len: int) -> None:
        self.free = budget
        self.policy = policy
        self.max_model_len = max_model_len
        self.held: dict[int, int] = {}

    def size(self, n_in: int, n_out: int) -> int:
        if self.policy == "reserve-max":
            return self.max_model_len
        if self.policy == "reserve-pow2":
            pow2 = min(n_in + (1 << max(0, n_out - 1).bit_length()), self.max_model_len)
            return max(pow2, n_in + n_out)
        return n_in + n_out

    def admit(self, rid: int, n_in: int, n_out: int) -> bool:
        size = self.size(n_in, n_out)
        if size > self.free:
            return False
        self.free -= size
        self.held[rid] = size
        return True

    def release(self, rid: int) -> None:
        self.free += self.held.pop(rid)

    def reserved(self) -> int:
        return sum(self.held.values())


def simulate(
    dist: LengthDistribution,
    allocator: str,
    *,
    num_requests: int = 2000,
    budget_tokens: int = 32768,
    block_size: int = 16,
    max_model_len: int = 2048,
    watermark_fraction: float = 0.01,
    seed: int = 0,
    trace: list[StepSample] | None = None,
) -> WasteResult:
    """Run one workload through one allocator; the result averages over the contended steps.

    With ``trace``, one :class:`StepSample` per step is appended to it: every step, including
    the drain at the end when nothing waits any more.
    """
    rng = random.Random(seed)
    lengths = [dist.sample(rng, max_model_len) for _ in range(num_requests)]
    waiting: deque[int] = deque(range(num_requests))
    running: list[int] = []  # admission order
    stored = dict.fromkeys(range(num_requests), 0)  # tokens with K/V in the cache
    pool = (
        BlockPool(budget_tokens // block_size, block_size=block_size, enable_prefix_caching=False)
        if allocator == "paged"
        else None
    )
    contiguous = _Reservation(budget_tokens, allocator, max_model_len) if pool is None else None
    watermark = math.ceil(watermark_fraction * budget_tokens / block_size)
    utils: list[tuple[int, float]] = []
    concurrency: list[int] = []
    preemptions = 0
    while waiting or running:
        # Decode: every running sequence stores one more token (its last generated one).
        for rid in list(running):
            if rid not in running:  # preempted earlier in this step
                continue
            n_in, n_out = lengths[rid]
            if stored[rid] == n_in + n_out - 1:  # the final token is never fed back
                running.remove(rid)
                pool.free(rid) if pool else contiguous.release(rid)  # type: ignore[union-attr]
                continue
            if pool is not None:
                while pool.append(rid, (0,)) is None:
                    victim = running.pop()  # recompute: keeps its tokens, drops its KV
                    pool.free(victim)
                    waiting.appendleft(victim)
                    preemptions += 1
                    if victim == rid:
                        break
                if rid not in running:
                    continue
            stored[rid] += 1
        # Admission: FCFS (preempted requests first) while the allocator can hold the prompt
        # (with a recomputed request's generated tokens) and, paged, keep a watermark free.
        while waiting:
            rid = waiting[0]
            n_in, n_out = lengths[rid]
            if pool is not None:
                n = max(stored[rid], n_in)
                need = -(-n // block_size) + watermark
                ok = need <= pool.num_free_device_blocks and pool.allocate(rid, [0] * n) is not None
            else:
                n = n_in
                ok = contiguous.admit(rid, n_in, n_out)  # type: ignore[union-attr]
            if not ok:
                break
            waiting.popleft()
            running.append(rid)
            stored[rid] = n
        if not running:
            if waiting:
                raise ValueError(f"request lengths {lengths[waiting[0]]} never fit the budget.")
            break
        tokens = sum(stored[r] for r in running)
        if pool is not None:
            reserved = pool.statistics().num_held_device_blocks * block_size
        else:
            reserved = contiguous.reserved()  # type: ignore[union-attr]
        if trace is not None:
            trace.append(StepSample(tokens, reserved, len(running), len(waiting)))
        if waiting:  # steady state: the budget is contended
            utils.append((tokens, tokens / reserved))
            concurrency.append(len(running))
    if not utils:
        raise ValueError("the budget was never contended: raise num_requests or lower the budget.")
    _peak_tokens, peak_util = max(utils)
    return WasteResult(
        distribution=dist.name,
        allocator=allocator,
        block_size=block_size,
        budget_tokens=budget_tokens,
        num_requests=num_requests,
        mean_input_len=sum(i for i, _ in lengths) / num_requests,
        mean_output_len=sum(o for _, o in lengths) / num_requests,
        utilization_mean=sum(u for _, u in utils) / len(utils),
        utilization_at_peak=peak_util,
        utilization_min=min(u for _, u in utils),
        concurrent_mean=sum(concurrency) / len(concurrency),
        concurrent_max=max(concurrency),
        num_steps=len(utils),
        num_preemptions=preemptions,
    )


def format_table(results: list[WasteResult]) -> str:
    head = (
        f"{'workload':<9} {'allocator':<15} {'block':>5} {'util mean':>9} {'util@peak':>9} "
        f"{'util min':>8} {'seqs mean':>9} {'seqs max':>8} {'preempt':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        block = str(r.block_size) if r.allocator == "paged" else "-"
        lines.append(
            f"{r.distribution:<9} {r.allocator:<15} {block:>5} {r.utilization_mean:>9.1%} "
            f"{r.utilization_at_peak:>9.1%} {r.utilization_min:>8.1%} {r.concurrent_mean:>9.1f} "
            f"{r.concurrent_max:>8} {r.num_preemptions:>7}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    results: list[WasteResult] = []
    for name in args.distributions.split(","):
        dist = DISTRIBUTIONS[name]
        for allocator in ALLOCATORS:
            sizes = [int(s) for s in args.block_sizes.split(",")] if allocator == "paged" else [1]
            for block_size in sizes:
                results.append(
                    simulate(
                        dist,
                        allocator,
                        num_requests=args.num_requests,
                        budget_tokens=args.budget_tokens,
                        block_size=block_size,
                        max_model_len=args.max_model_len,
                        seed=args.seed,
                    )
                )
    out = [
        f"KV budget {args.budget_tokens} token slots, {args.num_requests} requests per workload, "
        f"max_model_len {args.max_model_len}, seed {args.seed}; utilization = tokens stored / "
        "slots reserved, over the steps while requests wait.",
        format_table(results),
    ]
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("waste-report", help="KV waste: paged pool vs contiguous reservation")
    p.add_argument("--distributions", default="sharegpt,alpaca")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--budget-tokens", type=int, default=32768)
    p.add_argument("--block-sizes", default="16", help="comma-separated, for the paged pool")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(func=run)
