"""Benchmark of the Triton quantized matmuls (``triton_quant_matmul``) on CUDA against torch's
float32 and bfloat16 matmul of the dequantized weights.

``python -m asyncpaged.kernels.triton_quant_matmul_bench [--json out]`` (``scripts/gpu_check.sh``
runs it). For each weight format (the GGUF types, int4 with groups of 128, fp8 per channel) and
shape (M, N, K): the median time of the Triton product, the quantized bytes it reads per second,
and the median times of ``x @ W.T`` with W dequantized beforehand, in float32 (torch's default
precision, no TF32: the same arithmetic) and in bfloat16. Times are CUDA-event times of one
call; every operand cycles through enough copies of its weights to exceed ``COLD_BYTES`` (over an
H100's 50 MB L2), so the weights come from memory as in a many-layer model. Without CUDA
(``--device cpu`` under ``TRITON_INTERPRET=1``) the same code runs with wall-clock times: a check
that it runs, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .quant_matmul import QTYPES, dequantize_rows
from .quant_matmul_bench import random_blocks
from .scaled_matmul import ScaledLayout, dequantize_codes
from .triton_quant_matmul import triton_quant_matmul, triton_scaled_matmul

__all__ = ["TritonMatmulTiming", "bench_shape", "main"]

SHAPES = tuple((m, nk, nk) for m in (1, 16, 256) for nk in (4096,))
COLD_BYTES = 96 << 20
FORMATS = (*QTYPES, "int4-g128", "fp8-channel")


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonMatmulTiming:
    """Medians of one format and shape (seconds); ``weight_gb_s``: GB/s of quantized weights."""

    format: str
    m: int
    n: int
    k: int
    quant_s: float
    weight_gb_s: float
    torch_f32_s: float
    torch_bf16_s: float


def median_s(calls: Sequence[Callable[[], object]], repeats: int, device: torch.device) -> float:
    """Median seconds of one call, cycling through ``calls`` after one warm-up round (CUDA
    events on CUDA, wall clock elsewhere)."""
    for call in calls:
        call()
    times = []
    for i in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            calls[i % len(calls)]()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)) / 1e3)
        else:
            begin = time.perf_counter()
            calls[i % len(calls)]()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _weights(
    fmt: str, n: int, k: int, device: torch.device
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]:
    """(product of x and a copy of the codes, the codes on ``device``, the float32 W on the CPU)."""
    if fmt in QTYPES:
        w = random_blocks(fmt, n, k)
        return (lambda x, c: triton_quant_matmul(x, c, fmt, k)), w.to(device), \
            dequantize_rows(w, fmt, k)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    if fmt == "int4-g128":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        layout = ScaledLayout(code="int4", in_features=k, scales=torch.rand(n, k // 128) * 0.01,
                              zeros=None, group_size=128, row_block=1,
                              scale_dtype=torch.float32)  # fmt: skip
    else:
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes
        layout = ScaledLayout(code="fp8_e4m3", in_features=k, scales=torch.rand(n, 1) * 0.01,
                              zeros=None, group_size=k, row_block=1,
                              scale_dtype=torch.float32)  # fmt: skip
    on_device = layout.to(device)
    weights = dequantize_codes(codes, layout)
    return (lambda x, c: triton_scaled_matmul(x, c, on_device)), codes.to(device), weights


def bench_shape(fmt: str, m: int, n: int, k: int, *, device: torch.device,
                repeats: int) -> TritonMatmulTiming:  # fmt: skip
    product, codes, weights = _weights(fmt, n, k, device)
    x = torch.randn(m, k, device=device)
    cold = COLD_BYTES if device.type == "cuda" else 0  # (the interpreter: one copy)
    quant_copies = [codes.clone() for _ in range(max(1, -(-cold // codes.numel())))]
    f32 = weights.to(device)
    f32_copies = [f32.clone() for _ in range(max(1, -(-cold // (n * k * 4))))]
    bf16_copies = [t.bfloat16() for t in f32_copies]
    xb = x.bfloat16()
    quant_s = median_s([functools.partial(product, x, c) for c in quant_copies], repeats, device)
    f32_s = median_s([functools.partial(torch.matmul, x, t.T) for t in f32_copies], repeats, device)
    bf16_s = median_s(
        [functools.partial(torch.matmul, xb, t.T) for t in bf16_copies], repeats, device
    )
    return TritonMatmulTiming(format=fmt, m=m, n=n, k=k, quant_s=quant_s,
                              weight_gb_s=codes.numel() / quant_s / 1e9, torch_f32_s=f32_s,
                              torch_bf16_s=bf16_s)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--m", type=int, nargs="*", help="rows of x (with --nk: instead of the defaults)"
    )
    parser.add_argument("--nk", type=int, nargs="*", help="N = K values (with --m)")
    parser.add_argument("--json", default=None, help="write the timings to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = SHAPES
    if args.m and args.nk:
        shapes = tuple((m, nk, nk) for nk in args.nk for m in args.m)
    name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (not a measurement)"
    )
    print(f"{name}; times in ms, medians")
    print(f"{'format':11} {'M':>4} {'N=K':>5} {'triton':>8} {'GB/s':>7} {'f32':>8} {'bf16':>8}")
    rows = []
    for fmt in args.formats:
        for m, n, k in shapes:
            r = bench_shape(fmt, m, n, k, device=device, repeats=args.repeats)
            rows.append(r)
            times = f"{r.torch_f32_s * 1e3:8.3f} {r.torch_bf16_s * 1e3:8.3f}"
            print(f"{fmt:11} {m:4d} {n:5d} {r.quant_s * 1e3:8.3f} {r.weight_gb_s:7.1f} {times}",
                  flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "timings": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
