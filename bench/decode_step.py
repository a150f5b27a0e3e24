"""Decode-step attention time per layer: paged (TorchAttentionBackend) vs a contiguous-cache SDPA.

Usage: ``python bench/decode_step.py [--threads 1] [--batch 32] [--context 512] ...``

Workload (the reference Llama's attention shapes): ``batch`` decoding sequences with context
lengths drawn uniformly from ``context ± jitter``, 8 query heads, 2 KV heads, head_dim 64,
float32, block size 16. Each measured call is one layer's decode attention, including the write
of the step's new K/V, as the runner does it:

* paged: ``TorchAttentionBackend.forward`` over a ``PagedKVCache`` whose block tables are a full
  random shuffle of the pool (no two logical neighbours adjacent);
* contiguous: K/V per sequence in ``[B, Hkv, L_max, D]``, the new row written in place, then one
  4-D SDPA with the query heads packed per KV head and a key-padding mask (no gather).

The KV working set spans ``--layers`` layers (default: enough for > 4x a 32 MB L3), visited in
turn so every call reads cold memory, as in a real multi-layer model. The two paths are
interleaved round by round; the table reports medians (and the 10th/90th percentiles).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncpaged.model.attention import AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.kv_cache import PagedKVCache

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch", type=int, default=32, help="decoding sequences")
    parser.add_argument("--context", type=int, default=512, help="mean context length")
    parser.add_argument("--jitter", type=int, default=64, help="context lengths: mean ± jitter")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=0, help="0: working set > 4x 32 MB")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds over all layers")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--group-size", type=int, default=8, help="decode_group_size")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class Workload:
    """Shared inputs: context lengths, queries and new K/V rows per layer."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        self.batch, self.block_size = args.batch, args.block_size
        self.context_lens = [
            rng.randint(args.context - args.jitter, args.context + args.jitter)
            for _ in range(args.batch)
        ]
        bytes_per_layer = 2 * sum(self.context_lens) * KV_HEADS * HEAD_DIM * 4
        self.num_layers = args.layers or max(2, math.ceil(4 * 32 * 2**20 / bytes_per_layer))
        self.bytes_per_layer = bytes_per_layer
        gen = torch.Generator().manual_seed(args.seed)
        self.query = torch.randn(self.num_layers, args.batch, HEADS, HEAD_DIM, generator=gen)
        self.new_k = torch.randn(self.num_layers, args.batch, KV_HEADS, HEAD_DIM, generator=gen)
        self.new_v = torch.randn(self.num_layers, args.batch, KV_HEADS, HEAD_DIM, generator=gen)
        self.scale = HEAD_DIM**-0.5


Paged = tuple[Callable[[int], torch.Tensor], PagedKVCache, list[list[int]]]


def make_paged(w: Workload, seed: int, group_size: int) -> Paged:
    bs = w.block_size
    tables_len = [-(-n // bs) for n in w.context_lens]
    num_blocks = sum(tables_len)
    cache = PagedKVCache(
        num_layers=w.num_layers,
        num_blocks=num_blocks,
        block_size=bs,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
    )
    cache.key.normal_(generator=torch.Generator().manual_seed(seed))
    cache.value.normal_(generator=torch.Generator().manual_seed(seed + 1))
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)  # a fully shuffled block table
    tables, slots, start = [], [], 0
    for n, nb in zip(w.context_lens, tables_len, strict=True):
        table = pool[start : start + nb]
        start += nb
        tables.append(table)
        slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
    metadata = AttentionMetadata.build(
        query_lens=[1] * w.batch,
        context_lens=w.context_lens,
        block_tables=tables,
        slot_mapping=slots,
        device=torch.device("cpu"),
    )
    backend = TorchAttentionBackend(decode_group_size=group_size)

    def run(layer: int) -> torch.Tensor:
        return backend.forward(
            layer,
            w.query[layer],
            w.new_k[layer],
            w.new_v[layer],
            cache,
            metadata,
            scale=w.scale,
        )

    return run, cache, tables


def make_contiguous(
    w: Workload, cache: PagedKVCache, tables: list[list[int]]
) -> Callable[[int], torch.Tensor]:
    """The same K/V as the paged cache, copied into per-sequence contiguous tensors."""
    max_len = max(w.context_lens)
    shape = (w.num_layers, w.batch, KV_HEADS, max_len, HEAD_DIM)
    keys, values = torch.zeros(shape), torch.zeros(shape)
    for b, (table, n) in enumerate(zip(tables, w.context_lens, strict=True)):
        blocks = torch.tensor(table)
        k = cache.key[:, blocks].permute(0, 2, 1, 4, 3)  # [layers, Hkv, nb, bs, D]
        v = cache.value[:, blocks].permute(0, 2, 1, 3, 4)
        keys[:, b, :, :n] = k.reshape(w.num_layers, KV_HEADS, -1, HEAD_DIM)[:, :, :n]
        values[:, b, :, :n] = v.reshape(w.num_layers, KV_HEADS, -1, HEAD_DIM)[:, :, :n]
    lens = torch.tensor(w.context_lens)
    rows = torch.arange(w.batch)
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    group = HEADS // KV_HEADS

    def run(layer: int) -> torch.Tensor:
        k, v = keys[layer], values[layer]  # [B, Hkv, L, D]
        k[rows, :, lens - 1] = w.new_k[layer]
        v[rows, :, lens - 1] = w.new_v[layer]
        q = w.query[layer].view(w.batch, KV_HEADS, group, HEAD_DIM)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=w.scale)
        return o.reshape(w.batch, HEADS, HEAD_DIM)

    return run


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    w = Workload(args)
    paged, cache, tables = make_paged(w, args.seed, args.group_size)
    paths: dict[str, Callable[[int], torch.Tensor]] = {
        "paged": paged,
        "contiguous": make_contiguous(w, cache, tables),
    }
    with torch.inference_mode():
        error = (paths["paged"](0) - paths["contiguous"](0)).abs().max().item()
    assert error < 1e-4, f"paged and contiguous attention disagree by {error}"
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for round_idx in range(args.warmup + args.rounds):
            order = list(paths) if round_idx % 2 == 0 else list(reversed(paths))
            for name in order:
                fn = paths[name]
                for layer in range(w.num_layers):
                    t0 = time.perf_counter()
                    fn(layer)
                    elapsed = time.perf_counter() - t0
                    if round_idx >= args.warmup:
                        times[name].append(elapsed)
    print(
        f"decode attention per layer: batch {w.batch}, context {args.context}±{args.jitter} "
        f"(mean {statistics.mean(w.context_lens):.0f}), {HEADS} heads / {KV_HEADS} KV heads x "
        f"{HEAD_DIM}, fp32, block {w.block_size}, {w.num_layers} layers "
        f"({w.num_layers * w.bytes_per_layer / 2**20:.0f} MiB KV), threads {args.threads}, "
        f"{args.rounds} rounds"
    )
    base = statistics.median(times["contiguous"])
    print(f"{'path':<12}{'median us':>11}{'p10 us':>9}{'p90 us':>9}{'vs contiguous':>15}")
    for name, samples in times.items():
        deciles = statistics.quantiles(samples, n=10)
        median = statistics.median(samples)
        print(
            f"{name:<12}{median * 1e6:>11.0f}{deciles[0] * 1e6:>9.0f}{deciles[-1] * 1e6:>9.0f}"
            f"{median / base:>14.2f}x"
        )


if __name__ == "__main__":
    main()
