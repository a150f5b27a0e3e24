"""Decode attention per layer: the native CPU kernel vs contiguous torch attention and the torch
paged backend, with cold KV; ``--mode prefill`` and ``--mode write`` time the prefill kernel and
the K/V cache write against their torch paths.

Usage: ``python bench/cpu_attention.py [--threads 1] [--batches 8 32 64] [--contexts 128 512 2048]``
``python bench/cpu_attention.py --mode prefill|write [--threads 1]``
``python bench/cpu_attention.py --mode kv [--batches 16] [--contexts 512 2048 8192]``

Workload: ``batch`` decoding sequences of ``context`` tokens each, 8 query heads, 2 KV heads,
head_dim 64, block size 16. Each layer's block tables are a full random shuffle of its pool, and
the layers are visited in turn with enough of them that the KV working set is > 4x a 32 MB L3,
so every call reads cold memory (as in a real multi-layer model). Paths, timed per layer call:

* ``cpp``: the kernel through a ``DecodePlan`` made once and run per layer, as the backend does
  per step (output preallocated); ``cpp_call``: the one-call ``paged_decode_attention``, which
  makes a one-off plan on every call (~12 us more);
* ``cpp_seq``: the same kernel with each sequence's blocks in physical order, one after another
  (the tables a pool that never fragments would give): what paging over a shuffled table costs;
* ``cpp_backend``: ``CpuAttentionBackend.forward`` (slot mapping -1: nothing written);
* ``torch_backend``: ``TorchAttentionBackend.forward`` on the same metadata;
* ``contig_*``: fp32 K/V per layer in contiguous ``[B, Hkv, L, D]``, query heads packed per KV
  head (``q.view(B, Hkv, G, D)``): ``sdpa`` (4-D SDPA), ``matmul`` (``q @ K^T``, softmax,
  ``@ V``), ``sdpa_gqa`` (SDPA over ``[B, Hq, 1, D]`` with ``enable_gqa``). ``best contig`` is the
  fastest of them and the denominator of ``cpp/contig``.

Each call must read the K/V of every context position once (``2 x B x Hkv x ctx x D``
elements): ``GB/s`` is the kernel's read rate on the shuffled table, and ``seq/contig`` the
ratio ``cpp_seq`` reaches, where the hardware prefetcher can follow the blocks.

With ``--dtypes float32 bfloat16`` the paged cache is also run in bf16 storage (contiguous stays
fp32: the baseline is the best fp32 torch path). Paths are interleaved round by round and the
table reports medians; run one process per thread count.

``--mode prefill``: one layer's prefill attention for a few step shapes (prompts of one length,
or a chunk on a cached prefix), same heads: ``cpp`` (``paged_prefill_attention``, default tiling:
online softmax over key tiles), ``cpp_2pass`` (the same kernel, one key tile: two-pass) and
``torch`` (the torch backend's per-sequence gather + SDPA). ``--mode write``: the K/V write of a
decode step (64 tokens in 64 random blocks) and a 2048-token prefill into a 6-layer cache, torch
(``PagedKVCache.write_targets``) vs the native write, per 6 layers.

``--mode kv``: the decode kernel (a ``DecodePlan`` per case, as ``cpp`` above) over a cache in
each KV dtype, bfloat16 and float32 against the quantized ones (int8, fp8 e4m3 / e5m2 codes with
a bfloat16 scale per token and KV head), same shapes, shuffled tables and cold KV (the layer
count keeps the smallest cache > ``--cold-factor`` x 32 MB, so every dtype's is); the dtypes run
interleaved round by round in one process. Each is checked first against the float64 reference
on its own (dequantized) values. ``GB/s`` counts the bytes a call must read, scales included.
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

from asyncpaged.kernels.cpu_attention import (
    CpuAttentionBackend,
    DecodePlan,
    paged_decode_attention,
    reference_paged_decode,
)
from asyncpaged.kernels.cpu_build import load_library
from asyncpaged.kernels.cpu_ops import launch_write, paged_prefill_attention
from asyncpaged.model.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    _prefill_one,
    _write,
)
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.kv_quant import bytes_per_row, kv_cache_torch_dtype

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16
L3_BYTES = 32 * 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["decode", "prefill", "write", "kv"], default="decode")
    parser.add_argument("--threads", type=int, default=1, help="torch and kernel threads")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument(
        "--dtypes", nargs="+", help="default: float32 bfloat16 (--mode kv: and int8 fp8_e4m3 "
        "fp8_e5m2)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds over all layers")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--cold-factor", type=float, default=4.0, help="KV set / L3")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


Path = Callable[[int], object]


def make_case(
    batch: int, context: int, dtype: torch.dtype, cold_factor: float, seed: int
) -> tuple[int, dict[str, Path]]:
    """The layer count (enough to keep KV cold) and every path, for one case."""
    group = HEADS // KV_HEADS
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    bytes_per_layer = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    num_layers = max(2, math.ceil(cold_factor * L3_BYTES / bytes_per_layer))
    cache = PagedKVCache(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
    )
    gen = torch.Generator().manual_seed(seed)
    for t in (cache.key, cache.value):
        t.copy_(torch.randn(t.shape, generator=gen))
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)  # a fully shuffled block table
    tables = [pool[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    md = AttentionMetadata.build(
        query_lens=[1] * batch,
        context_lens=[context] * batch,
        block_tables=tables,
        slot_mapping=[-1] * batch,
        device=torch.device("cpu"),
    )
    query = torch.randn(num_layers, batch, HEADS, HEAD_DIM, generator=gen)
    new_kv = torch.zeros(batch, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    out = torch.empty(batch, HEADS, HEAD_DIM)
    torch_backend, cpu_backend = TorchAttentionBackend(), CpuAttentionBackend()
    assert cpu_backend.is_native, "the CPU kernel did not build (see the log)"

    k0, v0 = cache.layer(0)
    plan = DecodePlan(query[0], k0, v0, md.block_tables, md.context_lens, scale)

    def cpp(layer: int) -> object:
        k, v = cache.layer(layer)
        return plan.run(query[layer], k, v, out)

    def cpp_call(layer: int) -> object:
        k, v = cache.layer(layer)
        return paged_decode_attention(
            query[layer], k, v, md.block_tables, md.context_lens, scale, out=out
        )

    # The same K/V moved so that sequence i's blocks are i * blocks_per_seq onward, in order.
    seq_cache = PagedKVCache(
        num_layers=num_layers, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, dtype=dtype,
    )  # fmt: skip
    flat = torch.tensor(tables).view(-1)
    seq_cache.key.copy_(cache.key[:, flat])
    seq_cache.value.copy_(cache.value[:, flat])
    seq_tables = torch.arange(num_blocks, dtype=torch.int64).view(batch, blocks_per_seq)
    seq_plan = DecodePlan(query[0], k0, v0, seq_tables, md.context_lens, scale)

    def cpp_seq(layer: int) -> object:
        k, v = seq_cache.layer(layer)
        return seq_plan.run(query[layer], k, v, out)

    def backend_path(backend: TorchAttentionBackend) -> Path:
        def run(layer: int) -> object:
            return backend.forward(layer, query[layer], new_kv, new_kv, cache, md, scale=scale)

        return run

    # Contiguous fp32 K/V [layers, B, Hkv, L, D], the same values as the paged cache.
    blocks = torch.tensor(tables).view(-1)
    keys = cache.key[:, blocks].float().view(num_layers, batch, blocks_per_seq, KV_HEADS, HEAD_DIM,
                                             BLOCK)  # fmt: skip
    keys = keys.permute(0, 1, 3, 2, 5, 4).reshape(num_layers, batch, KV_HEADS, -1, HEAD_DIM)
    values = cache.value[:, blocks].float().view(num_layers, batch, blocks_per_seq, KV_HEADS,
                                                 BLOCK, HEAD_DIM)  # fmt: skip
    values = values.permute(0, 1, 3, 2, 4, 5).reshape(num_layers, batch, KV_HEADS, -1, HEAD_DIM)
    keys, values = keys[:, :, :, :context].contiguous(), values[:, :, :, :context].contiguous()

    def contig_sdpa(layer: int) -> object:
        q = query[layer].view(batch, KV_HEADS, group, HEAD_DIM)
        return F.scaled_dot_product_attention(q, keys[layer], values[layer], scale=scale)

    def contig_matmul(layer: int) -> object:
        q = query[layer].view(batch, KV_HEADS, group, HEAD_DIM)
        probs = torch.softmax(q @ keys[layer].transpose(2, 3) * scale, dim=-1)
        return probs @ values[layer]

    def contig_sdpa_gqa(layer: int) -> object:
        q = query[layer].view(batch, HEADS, 1, HEAD_DIM)
        return F.scaled_dot_product_attention(
            q, keys[layer], values[layer], scale=scale, enable_gqa=True
        )

    paths: dict[str, Path] = {
        "cpp": cpp,
        "cpp_call": cpp_call,
        "cpp_seq": cpp_seq,
        "cpp_backend": backend_path(cpu_backend),
        "torch_backend": backend_path(torch_backend),
        "contig_sdpa": contig_sdpa,
        "contig_matmul": contig_matmul,
        "contig_sdpa_gqa": contig_sdpa_gqa,
    }
    with torch.inference_mode():
        want = paths["contig_sdpa"](0)
        assert isinstance(want, torch.Tensor)
        for name, fn in paths.items():
            got = fn(0)
            assert isinstance(got, torch.Tensor)
            error = (got.reshape(want.shape).float() - want).abs().max().item()
            assert error < 1e-4, f"{name} disagrees with contiguous SDPA by {error}"
    return num_layers, paths


def time_case(
    num_layers: int, paths: dict[str, Path], rounds: int, warmup: int
) -> dict[str, float]:
    """Median seconds per layer call of each path, interleaved round by round."""
    samples: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for round_idx in range(warmup + rounds):
            order = list(paths) if round_idx % 2 == 0 else list(reversed(paths))
            for name in order:
                fn = paths[name]
                t0 = time.perf_counter()
                for layer in range(num_layers):
                    fn(layer)
                if round_idx >= warmup:
                    samples[name].append((time.perf_counter() - t0) / num_layers)
    return {name: statistics.median(s) for name, s in samples.items()}


# (name, [(cached, new)] per sequence) for --mode prefill
PREFILL_STEPS = (
    ("32 x 32", [(0, 32)] * 32),
    ("16 x 128", [(0, 128)] * 16),
    ("8 x 256", [(0, 256)] * 8),
    ("1 x 2048", [(0, 2048)]),
    ("512 on 1536", [(1536, 512)]),
    ("4 x 64 on 256", [(256, 64)] * 4),
)


def prefill_paths(
    shapes: list[tuple[int, int]], dtype: torch.dtype, seed: int
) -> dict[str, Callable[[], object]]:
    """The prefill paths of one layer for one step shape (the cache holds every position)."""
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in shapes)
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, KV_HEADS, HEAD_DIM, BLOCK, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = []
    for cached, new in shapes:
        count = -(-(cached + new) // BLOCK)
        tables.append(pool[:count])
        pool = pool[count:]
    md = AttentionMetadata.build(
        query_lens=[n for _, n in shapes],
        context_lens=[c + n for c, n in shapes],
        block_tables=tables,
        slot_mapping=[-1] * sum(n for _, n in shapes),
        device=torch.device("cpu"),
    )
    query = torch.randn(sum(n for _, n in shapes), HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def cpp(key_tile_blocks: int | None) -> Callable[[], object]:
        extra = {} if key_tile_blocks is None else {"key_tile_blocks": key_tile_blocks}
        return lambda: paged_prefill_attention(
            query, key_cache, value_cache, md.block_tables, md.query_start_loc, md.context_lens,
            scale, out=out, **extra,
        )  # fmt: skip

    def torch_path() -> object:
        for i in md.prefill_indices:
            _prefill_one(i, out, query, key_cache, value_cache, md, scale, None)
        return out

    return {"cpp": cpp(None), "cpp_2pass": cpp(0), "torch": torch_path}


def write_paths(n: int, dtype: torch.dtype, seed: int) -> dict[str, Callable[[], object]]:
    """The K/V write of ``n`` tokens into each layer of a 6-layer cache: a decode step (one token
    per random block) when ``n`` <= 64, else one prompt over shuffled blocks."""
    num_layers, num_blocks = 6, 4096
    cache = PagedKVCache(
        num_layers=num_layers, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, dtype=dtype,
    )  # fmt: skip
    rng = random.Random(seed)
    if n <= 64:
        slots = [b * BLOCK + rng.randrange(BLOCK) for b in rng.sample(range(num_blocks), n)]
    else:
        blocks = rng.sample(range(num_blocks), -(-n // BLOCK))
        slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    md = AttentionMetadata.build(
        query_lens=[n], context_lens=[n], block_tables=[[0]], slot_mapping=slots,
        device=torch.device("cpu"),
    )  # fmt: skip
    kv = torch.randn(num_layers, 2, n, KV_HEADS, HEAD_DIM)
    lib = load_library()
    assert lib is not None, "the CPU kernel did not build (see the log)"

    def torch_write() -> object:
        for layer in range(num_layers):
            _write(cache, layer, kv[layer, 0], kv[layer, 1], md)
        return None

    def native_write() -> object:
        for layer in range(num_layers):
            k, v = cache.layer(layer)
            launch_write(lib, kv[layer, 0], kv[layer, 1], k, v, md.slot_mapping, None)
        return None

    return {"torch": torch_write, "cpp": native_write}


def time_calls(paths: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each path, interleaved round by round (one warm-up round)."""
    samples: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for round_idx in range(1 + rounds):
            order = list(paths) if round_idx % 2 == 0 else list(reversed(paths))
            for name in order:
                t0 = time.perf_counter()
                paths[name]()
                if round_idx:
                    samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def main_prefill(args: argparse.Namespace) -> None:
    print(
        f"prefill attention per layer call (median ms), {HEADS} heads / {KV_HEADS} KV heads x "
        f"{HEAD_DIM}, block {BLOCK}, threads {args.threads}, {args.rounds} rounds"
    )
    print(f"{'kv':<5}{'step':<16}{'cpp':>9}{'cpp_2pass':>11}{'torch':>9}{'torch/cpp':>11}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, shapes in PREFILL_STEPS:
            t = time_calls(prefill_paths(shapes, dtype, args.seed), args.rounds)
            print(
                f"{'bf16' if dtype == torch.bfloat16 else 'fp32':<5}{name:<16}"
                f"{t['cpp'] * 1e3:>9.2f}{t['cpp_2pass'] * 1e3:>11.2f}{t['torch'] * 1e3:>9.2f}"
                f"{t['torch'] / t['cpp']:>10.2f}x",
                flush=True,
            )


def main_write(args: argparse.Namespace) -> None:
    print(f"K/V cache write, 6 layers (median us), threads {args.threads}, {args.rounds} rounds")
    print(f"{'kv':<5}{'step':<16}{'torch':>9}{'cpp':>9}{'torch/cpp':>11}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, n in (("decode 64", 64), ("prefill 2048", 2048)):
            t = time_calls(write_paths(n, dtype, args.seed), 3 * args.rounds)
            print(
                f"{'bf16' if dtype == torch.bfloat16 else 'fp32':<5}{name:<16}"
                f"{t['torch'] * 1e6:>9.0f}{t['cpp'] * 1e6:>9.0f}{t['torch'] / t['cpp']:>10.2f}x",
                flush=True,
            )


def kv_dtype_paths(
    batch: int, context: int, names: list[str], cold_factor: float, seed: int
) -> tuple[int, dict[str, Path]]:
    """The layer count and one decode-plan path per KV dtype name, for one case."""
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    dtypes = {name: kv_cache_torch_dtype(name, torch.float32) for name in names}
    smallest = min(bytes_per_row(d, HEAD_DIM) for d in dtypes.values())
    bytes_per_layer = 2 * num_blocks * BLOCK * KV_HEADS * smallest
    num_layers = max(2, math.ceil(cold_factor * L3_BYTES / bytes_per_layer))
    gen = torch.Generator().manual_seed(seed)
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)  # a fully shuffled block table
    tables = torch.tensor(pool, dtype=torch.int64).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int64)
    query = torch.randn(num_layers, batch, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty(batch, HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    paths: dict[str, Path] = {}
    for name, dtype in dtypes.items():
        cache = PagedKVCache(
            num_layers=num_layers, num_blocks=num_blocks, block_size=BLOCK,
            num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
        )  # fmt: skip
        for t in cache.key, cache.value:
            if dtype == torch.int8:
                t.copy_(torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8))
            else:
                t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
        for t in () if cache.key_scale is None else (cache.key_scale, cache.value_scale):
            assert t is not None
            t.copy_(torch.rand(t.shape, generator=gen) * 0.02 + 0.01)
        scales = cache.layer_scales(0) or (None, None)
        plan = DecodePlan(query[0], *cache.layer(0), tables, context_lens, scale,
                          key_scale=scales[0], value_scale=scales[1])  # fmt: skip

        def run(layer: int, cache: PagedKVCache = cache, plan: DecodePlan = plan) -> object:
            scales = cache.layer_scales(layer) or (None, None)
            return plan.run(query[layer], *cache.layer(layer), out, key_scale=scales[0],
                            value_scale=scales[1])  # fmt: skip

        checked = slice(0, min(batch, 4))
        want = reference_paged_decode(
            query[0, checked], *cache.layer(0), tables[checked], context_lens[checked], scale,
            key_scale=scales[0], value_scale=scales[1],
        )  # fmt: skip
        got = run(0)
        assert isinstance(got, torch.Tensor)
        error = (got[checked].double() - want).abs().max().item()
        assert error < 1e-4, f"{name} disagrees with the float64 reference by {error}"
        paths[name] = run
    return num_layers, paths


def main_kv(args: argparse.Namespace) -> None:
    names = args.dtypes or ["float32", "bfloat16", *("int8", "fp8_e4m3", "fp8_e5m2")]
    print(
        f"decode attention per layer call by KV dtype (median us), {HEADS} heads / {KV_HEADS} KV "
        f"heads x {HEAD_DIM}, block {BLOCK}, shuffled tables, smallest KV set > "
        f"{args.cold_factor:g}x 32 MB, threads {args.threads}, {args.rounds} rounds"
    )
    base = "bfloat16" if "bfloat16" in names else names[0]
    print(f"{'B':>4}{'ctx':>6}  " + "".join(f"{n:>18}" for n in names) + f"   (x {base}, GB/s)")
    for batch in args.batches:
        for context in args.contexts:
            num_layers, paths = kv_dtype_paths(batch, context, names, args.cold_factor, args.seed)
            t = time_case(num_layers, paths, args.rounds, args.warmup)
            cells = []
            for name in names:
                dtype = kv_cache_torch_dtype(name, torch.float32)
                kv_bytes = 2 * batch * KV_HEADS * context * bytes_per_row(dtype, HEAD_DIM)
                ratio, rate = t[name] / t[base], kv_bytes / t[name] / 1e9
                cells.append(f"{t[name] * 1e6:>7.0f} {ratio:>4.2f}x {rate:>4.1f}")
            print(f"{batch:>4}{context:>6}  " + "".join(f"{c:>18}" for c in cells), flush=True)
            del paths


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "kv":
        main_kv(args)
        return
    args.dtypes = args.dtypes or ["float32", "bfloat16"]
    if args.mode != "decode":
        (main_prefill if args.mode == "prefill" else main_write)(args)
        return
    print(
        f"decode attention per layer call (median us), {HEADS} heads / {KV_HEADS} KV heads x "
        f"{HEAD_DIM}, block {BLOCK}, shuffled tables, KV set > {args.cold_factor:g}x 32 MB, "
        f"threads {args.threads}, {args.rounds} rounds"
    )
    header = (
        f"{'kv':<5}{'B':>4}{'ctx':>6}{'cpp':>9}{'cpp_call':>9}{'cpp_seq':>9}{'cpp_be':>9}"
        f"{'torch_be':>10}"
        f"{'sdpa':>9}{'matmul':>9}{'sdpa_gqa':>10}{'cpp/contig':>12}{'seq/contig':>12}"
        f"{'cpp/torch_be':>14}{'GB/s':>7}"
    )
    print(header)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for batch in args.batches:
            for context in args.contexts:
                num_layers, paths = make_case(batch, context, dtype, args.cold_factor, args.seed)
                t = time_case(num_layers, paths, args.rounds, args.warmup)
                best = min(t["contig_sdpa"], t["contig_matmul"], t["contig_sdpa_gqa"])
                kv_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * dtype.itemsize
                us = {name: f"{v * 1e6:.0f}" for name, v in t.items()}
                print(
                    f"{'bf16' if dtype == torch.bfloat16 else 'fp32':<5}{batch:>4}{context:>6}"
                    f"{us['cpp']:>9}{us['cpp_call']:>9}{us['cpp_seq']:>9}{us['cpp_backend']:>9}"
                    f"{us['torch_backend']:>10}{us['contig_sdpa']:>9}{us['contig_matmul']:>9}"
                    f"{us['contig_sdpa_gqa']:>10}{t['cpp'] / best:>11.2f}x"
                    f"{t['cpp_seq'] / best:>11.2f}x{t['cpp'] / t['torch_backend']:>13.2f}x"
                    f"{kv_bytes / t['cpp'] / 1e9:>7.1f}",
                    flush=True,
                )
                del paths


if __name__ == "__main__":
    main()
