"""Micro-benchmark of block-pool operations at pool sizes from 1k to 1M blocks.

For each pool size the pool is first filled to half its blocks with sequences of 64 blocks and
every third of them freed again (so the free structures are large and mixed); then each operation
is timed over rounds of batches (median of the rounds):
``allocate`` (a 64-token prompt, 4 blocks), ``append`` (one token; every 16th takes a block),
``fork``, ``append-cow`` (the first append after a fork: copy-on-write of the partial block),
and ``free``. Prefix caching is on, so full blocks are hashed and registered as in the engine.
The fill's objects are frozen out of Python's cyclic GC (``gc.freeze``), whose passes cost
O(live objects) whatever the pool does; a long-running engine can do the same.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from asyncpaged.kv.block_pool import BlockPool

OPS = ("allocate", "append", "fork", "append-cow", "free")


def bench_pool(num_blocks: int, *, num_ops: int = 20000, block_size: int = 16) -> dict[str, float]:
    """Median microseconds per operation on a half-full pool of ``num_blocks`` blocks."""
    pool = BlockPool(num_blocks, block_size=block_size)
    fill = list(range(64 * block_size))
    i = 0
    while pool.statistics().num_held_device_blocks + 64 <= num_blocks // 2:
        fill[0] = 1_000_000 + i  # distinct first block: no prefix sharing during the fill
        pool.allocate(f"fill{i}", fill)
        i += 1
    for j in range(0, i, 3):  # free every third: holes all over the pool
        pool.free(f"fill{j}")
    gc.collect()
    gc.freeze()  # the fill's objects would make every cyclic-GC pass cost O(pool)
    batch = max(1, min(num_ops, pool.num_free_device_blocks // 6))
    prompt = list(range(4 * block_size - 5))  # 59 tokens: 4 blocks, the last one partial
    samples: dict[str, list[float]] = {op: [] for op in OPS}
    for r in range(max(1, num_ops // batch)):
        _round(pool, samples, r, batch, prompt)
    samples["free"] = [t / 2 for t in samples["free"]]
    gc.unfreeze()
    if num_blocks <= 10_000:
        pool.check_invariants()
    return {op: statistics.median(times) for op, times in samples.items()}


def _round(
    pool: BlockPool, samples: dict[str, list[float]], r: int, batch: int, prompt: list[int]
) -> None:
    seqs = [f"r{r}a{k}" for k in range(batch)]
    forks = [f"r{r}f{k}" for k in range(batch)]
    first = 1_000_000 + r * batch
    _time(samples["allocate"], batch, lambda k: _allocate(pool, seqs[k], prompt, first + k))
    _time(samples["append"], batch, lambda k: pool.append(seqs[k], (7,)))
    _time(samples["fork"], batch, lambda k: pool.fork(seqs[k], forks[k]))
    _time(samples["append-cow"], batch, lambda k: pool.append(forks[k], (8,)))
    _time(samples["free"], batch, lambda k: _free_pair(pool, seqs[k], forks[k]))


def _allocate(pool: BlockPool, seq: str, prompt: list[int], first_token: int) -> None:
    prompt[0] = first_token  # a distinct prompt: no prefix hit
    pool.allocate(seq, prompt)


def _free_pair(pool: BlockPool, a: str, b: str) -> None:
    pool.free(b)
    pool.free(a)


def _time(out: list[float], n: int, fn: Callable[[int], object]) -> None:
    start = time.perf_counter_ns()
    for k in range(n):
        fn(k)
    out.append((time.perf_counter_ns() - start) / n / 1000)


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = {n: bench_pool(n, num_ops=args.num_ops) for n in sizes}
    head = f"{'blocks':>9} " + " ".join(f"{op:>11}" for op in OPS)
    lines = ["microseconds per operation, pool half full, prefix caching on", head]
    lines += [f"{n:>9} " + " ".join(f"{r[op]:>11.2f}" for op in OPS) for n, r in rows.items()]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(n): r for n, r in rows.items()}, f, indent=2)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("pool-bench", help="micro-benchmark of block-pool operations")
    p.add_argument("--sizes", default="1000,10000,100000,1000000")
    p.add_argument("--num-ops", type=int, default=20000)
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(func=run)
