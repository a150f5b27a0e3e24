"""Benchmark of the quantized matmul (``quant_matmul``) against torch's float32 and bf16 matmul.

``python -m asyncpaged.kernels.quant_matmul_bench [--threads 1] [--target avx2] [--json out]``.
For each GGUF type and shape (M, N, K): the median time of ``quant_matmul(x, w)`` (exact float32
activations), the weight bytes it reads per second (N x row_bytes / time), the median time of
the int8-activation path (``activations="int8"``; with ``--no-vnni`` also without AVX512-VNNI)
and of ``x @ W.T`` with W in float32 and of ``x.bfloat16() @ W.bfloat16().T`` (the same shape, W
dequantized beforehand). Times are CPU time of the calling thread (``time.thread_time``) with
one thread, so a busy neighbour on a shared machine moves them less; wall time with more.
Every operand cycles through enough copies of its weights to exceed ``COLD_BYTES``, so the
weights come from memory as in a many-layer model, not from the last-level cache.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .cpu_build import select_target
from .quant_matmul import QTYPES, dequantize_rows, native_quant_matmul, quant_matmul

DECODE_SHAPES = tuple((m, nk, nk) for m in (1, 16) for nk in (1024, 4096))
PREFILL_SHAPES = tuple((256, nk, nk) for nk in (1024, 2048, 4096))
COLD_BYTES = 96 << 20  # over the 32 MB L3 of the machines measured


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantMatmulTiming:
    """Medians of one type and shape (seconds); ``weight_gb_s``: GB/s of quantized weights."""

    qtype: str
    m: int
    n: int
    k: int
    quant_s: float
    weight_gb_s: float
    int8_s: float
    int8_no_vnni_s: float | None
    torch_f32_s: float
    torch_bf16_s: float


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row_bytes] uint8 of random blocks of ``qtype`` with fp16 scales in [-1, 1]."""
    q = QTYPES[qtype]
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, size=(n * (k // q.block_elems), q.block_bytes), dtype=np.uint8)
    offsets = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2)}.get(qtype, (0,))
    for off in offsets:
        scale = np.asarray(gen.uniform(-1.0, 1.0, size=blocks.shape[0]), dtype=np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def median_s(calls: Sequence[Callable[[], object]], repeats: int, threads: int = 1) -> float:
    """Median seconds of one call, cycling through ``calls`` (one warm-up round first): CPU time
    of this thread with one thread, wall time with more."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    for call in calls:
        call()
    times = []
    for i in range(repeats):
        start = clock()
        calls[i % len(calls)]()
        times.append(clock() - start)
    return statistics.median(times)


def bench_shape(
    qtype: str, m: int, n: int, k: int, *, target: str, threads: int, repeats: int,
    no_vnni: bool = False,
) -> QuantMatmulTiming:  # fmt: skip
    w = random_blocks(qtype, n, k)
    x = torch.randn(m, k)
    copies = max(1, -(-COLD_BYTES // (n * k * 4)))
    quant_copies = max(1, -(-COLD_BYTES // w.numel()))
    ws = [w.clone() for _ in range(quant_copies)]
    f32 = [dequantize_rows(w, qtype, k) for _ in range(copies)]
    bf16 = [t.bfloat16() for t in f32]
    xb = x.bfloat16()
    quant = functools.partial(quant_matmul, x, qtype=qtype, k=k, target=target, num_threads=threads)
    quant_s = median_s([functools.partial(quant, q) for q in ws], repeats, threads)
    int8_s = median_s(
        [functools.partial(quant, q, activations="int8") for q in ws], repeats, threads
    )
    no_vnni_s = None
    op = native_quant_matmul(target)
    if no_vnni and op is not None:
        q8 = QTYPES[qtype]
        calls = [functools.partial(op.int8, x, q, q8, k, threads, False) for q in ws]
        no_vnni_s = median_s(calls, repeats, threads)
    f32_s = median_s([functools.partial(torch.matmul, x, t.T) for t in f32], repeats, threads)
    bf16_s = median_s([functools.partial(torch.matmul, xb, t.T) for t in bf16], repeats, threads)
    return QuantMatmulTiming(
        qtype=qtype, m=m, n=n, k=k, quant_s=quant_s, weight_gb_s=w.numel() / quant_s / 1e9,
        int8_s=int8_s, int8_no_vnni_s=no_vnni_s, torch_f32_s=f32_s, torch_bf16_s=bf16_s,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", default=None, help="native build (default: the best here)")
    parser.add_argument("--types", nargs="*", default=list(QTYPES), choices=list(QTYPES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--prefill-repeats", type=int, default=5)
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--no-vnni", action="store_true", help="also time int8 without VNNI")
    parser.add_argument(
        "--m", type=int, nargs="*", help="rows of x (with --nk: instead of the defaults)"
    )
    parser.add_argument("--nk", type=int, nargs="*", help="N = K values (with --m)")
    parser.add_argument("--json", default=None, help="write the timings to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = args.target or select_target()
    shapes = DECODE_SHAPES + (() if args.no_prefill else PREFILL_SHAPES)
    if args.m and args.nk:
        shapes = tuple((m, nk, nk) for nk in args.nk for m in args.m)
    print(f"target {target}, {args.threads} thread(s); times in ms, medians")
    print(
        f"{'type':5} {'M':>4} {'N=K':>5} {'quant':>8} {'GB/s':>6} {'int8':>8} {'no-vnni':>8} "
        f"{'f32':>8} {'bf16':>8}"
    )
    rows = []
    for qtype in args.types:
        for m, n, k in shapes:
            repeats = args.prefill_repeats if m > 16 else args.repeats
            r = bench_shape(
                qtype, m, n, k, target=target, threads=args.threads, repeats=repeats,
                no_vnni=args.no_vnni,
            )  # fmt: skip
            rows.append(r)
            no_vnni = "-" if r.int8_no_vnni_s is None else f"{r.int8_no_vnni_s * 1e3:.3f}"
            print(
                f"{qtype:5} {m:4d} {n:5d} {r.quant_s * 1e3:8.3f} {r.weight_gb_s:6.1f} "
                f"{r.int8_s * 1e3:8.3f} {no_vnni:>8} "
                f"{r.torch_f32_s * 1e3:8.3f} {r.torch_bf16_s * 1e3:8.3f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": target, "threads": args.threads,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
