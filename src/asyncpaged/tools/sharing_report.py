"""KV memory saved by sharing blocks: parallel sampling and beam search (the paper's Fig. 15).

Each request is replayed through the real :class:`BlockPool`, one token per step,
and at every step we compare the device blocks it holds with the blocks its sequences would hold
each on their own (``ceil(length / block_size)`` per sequence). The saving is
``1 - sum(held) / sum(unshared)`` over all steps of all requests (a time average).

* Parallel sampling: the prompt is allocated once and forked ``n - 1`` times; each sample then
  grows to its own length (drawn from the workload's output lengths), its first write into the
  shared partial block copying it.
* Beam search: the real :class:`~asyncpaged.sched.beam_search.BeamSearcher` decides which beams
  survive, driven by a synthetic model (each beam's next-token logprobs are a seeded random
  log-softmax over a 1,000-token vocabulary); survivors fork, dropped beams are freed. How much
  beams share depends on how often they reconverge on a few parents, which a real model decides:
  these numbers show the mechanism, not a model's behaviour.
"""

from __future__ import annotations

import argparse
import math
import random
from typing import Any

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.sched.beam_search import BeamSearcher
from asyncpaged.tools.waste_report import DISTRIBUTIONS, LengthDistribution

BLOCK_SIZE = 16
VOCAB = 1000


def _unshared(lengths: list[int]) -> int:
    return sum(-(-n // BLOCK_SIZE) for n in lengths)


def parallel_sampling_saving(
    dist: LengthDistribution, n: int, *, num_requests: int = 200, seed: int = 0
) -> float:
    rng = random.Random(seed)
    held = unshared = 0
    for _r in range(num_requests):
        n_in, _ = dist.sample(rng, 2048)
        outs = [max(1, dist.sample(rng, 2048 - n_in)[1]) for _ in range(n)]
        pool = BlockPool(10_000, block_size=BLOCK_SIZE, enable_prefix_caching=False)
        pool.allocate(0, [0] * n_in)
        for i in range(1, n):
            pool.fork(0, i)
        lengths = [n_in] * n
        for step in range(max(outs)):
            for i in range(n):
                if step < outs[i]:
                    assert pool.append(i, (1,)) is not None
                    lengths[i] += 1
                elif step == outs[i]:
                    pool.free(i)
            live = [lengths[i] for i in range(n) if step < outs[i]]
            held += pool.statistics().num_held_device_blocks
            unshared += _unshared(live)
    return 1 - held / unshared


def beam_search_saving(
    dist: LengthDistribution, width: int, *, num_requests: int = 60, seed: int = 0
) -> float:
    rng = random.Random(seed)
    held = unshared = 0
    for _ in range(num_requests):
        n_in, n_out = dist.sample(rng, 2048)
        searcher = BeamSearcher(width=width, max_tokens=max(2, n_out), eos_token_ids=frozenset())
        pool = BlockPool(20_000, block_size=BLOCK_SIZE, enable_prefix_caching=False)
        ids = iter(range(10**9))
        first = next(ids)
        pool.allocate(first, [0] * n_in)
        searcher.start(first)
        lengths = {first: n_in}
        while True:
            top = {b.seq_id: _random_top(rng, 2 * width) for b in searcher.running}
            choices = searcher.step(top)
            if searcher.done:
                break
            new: list[int] = []
            used: set[int] = set()
            for c in choices:
                if c.parent in used:
                    child = next(ids)
                    pool.fork(c.parent, child)
                else:
                    used.add(c.parent)
                    child = c.parent
                new.append(child)
            for sid in list(lengths):
                if sid not in used:
                    pool.free(sid)
                    del lengths[sid]
            for sid, c in zip(new, choices, strict=True):
                assert pool.append(sid, (c.token,)) is not None
                lengths[sid] = pool.num_tokens(sid)
            searcher.assign(new)
            held += pool.statistics().num_held_device_blocks
            unshared += _unshared(list(lengths.values()))
    return 1 - held / unshared


def _random_top(rng: random.Random, k: int) -> list[tuple[int, float]]:
    """The k best tokens of a random log-softmax over VOCAB tokens (Gumbel logits)."""
    logits = [-math.log(-math.log(rng.random() or 1e-12)) for _ in range(VOCAB)]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    best = sorted(range(VOCAB), key=lambda v: -logits[v])[:k]
    return [(v, logits[v] - norm) for v in best]


PAPER = {
    ("parallel", "alpaca"): "6.1-9.8%",
    ("parallel", "sharegpt"): "16.2-30.5%",
    ("beam", "alpaca"): "37.6-55.2%",
    ("beam", "sharegpt"): "44.3-66.3%",
}


def run(args: argparse.Namespace) -> int:
    lines = [
        f"KV memory saved by sharing (block size {BLOCK_SIZE}, seed {args.seed})",
        f"{'workload':<9} {'mode':<9} {'n=2':>7} {'n=4':>7} {'n=6':>7}  paper (n=2..6)",
    ]
    for name in ("alpaca", "sharegpt"):
        dist = DISTRIBUTIONS[name]
        ps = [parallel_sampling_saving(dist, n, num_requests=args.num_requests, seed=args.seed)
              for n in (2, 4, 6)]  # fmt: skip
        bs = [beam_search_saving(dist, w, num_requests=max(10, args.num_requests // 4),
                                 seed=args.seed) for w in (2, 4, 6)]  # fmt: skip
        for mode, values in (("parallel", ps), ("beam", bs)):
            cells = " ".join(f"{v:>7.1%}" for v in values)
            lines.append(f"{name:<9} {mode:<9} {cells}  {PAPER[(mode, name)]}")
    print("\n".join(lines))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sharing-report", help="KV memory saved by parallel sampling / beams")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
