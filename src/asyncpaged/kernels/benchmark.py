"""Paged decode attention benchmark (CUDA): achieved bandwidth and the ratio to contiguous SDPA.

``python -m asyncpaged.kernels.benchmark [--out results.json]``. For each (batch, context) it times
``paged_attention`` over scattered block tables in the runner layout (K transposed per block) and
in vLLM's NHD layout, and ``F.scaled_dot_product_attention`` over contiguous K/V of the same
shapes; the tile plan is built once per shape, as the engine does once per step. Bandwidth
counts the K/V bytes each must read (queries and outputs are negligible).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from .paged_attention import TilePlan, attention_config, paged_attention, plan_tiles

PAGE = 16
SHAPES = [(1, 8192), (4, 4096), (16, 2048), (64, 1024), (128, 512), (256, 1024)]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int
) -> Callable[[], torch.Tensor]:
    try:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa; repeat outside the timed region
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k_rep, v_rep)


@dataclass(frozen=True)
class DecodeInputs:
    """One decode batch over a scattered paged cache in the runner layout."""

    query: torch.Tensor  # [batch, Hq, D]
    key: torch.Tensor  # physical [num_blocks, Hkv, D, PAGE]: K transposed per block
    value: torch.Tensor  # physical [num_blocks, Hkv, PAGE, D]
    meta: dict[str, Any]  # paged_attention's keyword arguments but the plan
    plan: TilePlan  # built once, as the engine's backend does for all layers of a step
    kv_bytes: int  # the K/V bytes one call must read

    def runner_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical [num_blocks, PAGE, Hkv, D] views ``paged_attention`` takes."""
        return self.key.permute(0, 3, 1, 2), self.value.permute(0, 2, 1, 3)


def decode_inputs(
    batch: int,
    context: int,
    *,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cuda",
) -> DecodeInputs:
    """Random queries and cache, every sequence at ``context`` tokens on shuffled blocks."""
    dev = torch.device(device)
    blocks_per_seq = context // PAGE
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator(device=dev).manual_seed(0)
    tables = torch.randperm(num_blocks - 1, device=dev, generator=gen)[: batch * blocks_per_seq]
    tables = (tables + 1).view(batch, blocks_per_seq)
    query = torch.randn(batch, num_heads, head_dim, device=dev, dtype=dtype)
    group = num_heads // kv_heads
    cfg = attention_config(1, group, head_dim=head_dim, elem_bytes=query.element_size())
    meta = {
        "block_tables": tables,
        "query_start_loc": torch.arange(batch + 1, device=dev, dtype=torch.int64),
        "context_lens": torch.full((batch,), context, device=dev, dtype=torch.int64),
        "query_lens": [1] * batch,
        "max_context_len": context,
        "scale": head_dim**-0.5,
    }
    return DecodeInputs(
        query=query,
        key=torch.randn((num_blocks, kv_heads, head_dim, PAGE), device=dev, dtype=dtype),
        value=torch.randn((num_blocks, kv_heads, PAGE, head_dim), device=dev, dtype=dtype),
        meta=meta,
        # A per-call plan adds two host-to-device copies that serialize small shapes.
        plan=plan_tiles([1] * batch, cfg.block_q, dev),
        kv_bytes=2 * batch * context * kv_heads * head_dim * query.element_size(),
    )


def bench_one(
    batch: int, context: int, *, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> dict[str, Any]:
    dev = torch.device("cuda")
    inputs = decode_inputs(
        batch, context, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype
    )
    query, meta, plan, kv_bytes = inputs.query, inputs.meta, inputs.plan, inputs.kv_bytes
    result: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    runner = inputs.runner_views()
    layouts = {"runner": runner, "nhd": (runner[0].contiguous(), runner[1].contiguous())}
    del inputs, runner
    for name, (k_cache, v_cache) in layouts.items():
        ms = do_bench(lambda k=k_cache, v=v_cache: paged_attention(query, k, v, **meta, plan=plan))
        result[f"paged_{name}_us"] = ms * 1e3
        result[f"paged_{name}_gbps"] = kv_bytes / (ms * 1e-3) / 1e9
    del layouts
    q = query[:, :, None, :]  # [B, Hq, 1, D]
    k = torch.randn(batch, kv_heads, context, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    ms = do_bench(_sdpa(q, k, v, num_heads // kv_heads))
    result["sdpa_contiguous_us"] = ms * 1e3
    result["sdpa_contiguous_gbps"] = kv_bytes / (ms * 1e-3) / 1e9
    for name in ("runner", "nhd"):
        result[f"paged_{name}_vs_sdpa"] = result["sdpa_contiguous_us"] / result[f"paged_{name}_us"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    heads = {"num_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": dtype}
    rows = []
    header = (
        f"{'batch':>5} {'ctx':>6} | {'runner us':>9} {'GB/s':>6} {'xSDPA':>5} | "
        f"{'nhd us':>8} {'GB/s':>6} {'xSDPA':>5} | {'sdpa us':>8} {'GB/s':>6}"
    )
    print(f"paged decode attention, {torch.cuda.get_device_name()}, {heads}", flush=True)
    print(header, flush=True)
    for batch, context in SHAPES:
        r = bench_one(batch, context, **heads)
        rows.append(r)
        runner = f"{r['paged_runner_us']:>9.1f} {r['paged_runner_gbps']:>6.0f}"
        nhd = f"{r['paged_nhd_us']:>8.1f} {r['paged_nhd_gbps']:>6.0f}"
        sdpa = f"{r['sdpa_contiguous_us']:>8.1f} {r['sdpa_contiguous_gbps']:>6.0f}"
        print(
            f"{batch:>5} {context:>6} | {runner} {r['paged_runner_vs_sdpa']:>5.2f} | "
            f"{nhd} {r['paged_nhd_vs_sdpa']:>5.2f} | {sdpa}",
            flush=True,
        )
    print("xSDPA = SDPA time / paged time (1.0 = as fast as contiguous SDPA)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            info = {"device": torch.cuda.get_device_name(), **heads, "rows": rows}
            json.dump(info, f, indent=1, default=str)


if __name__ == "__main__":
    main()
