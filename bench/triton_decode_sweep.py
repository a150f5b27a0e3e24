"""Tile sweep of the Triton paged decode kernel on CUDA (runner cache layout, bf16).

``python bench/triton_decode_sweep.py [--out sweep.json]``: for each (batch, context) of
``asyncpaged.kernels.benchmark`` times ``paged_attention`` under each (block_n, num_warps,
num_stages) and split count, next to contiguous SDPA, and prints the best per shape. Used to pick
the decode defaults of ``attention_config``; needs a CUDA device.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch
from triton.testing import do_bench  # type: ignore[import-untyped]

from asyncpaged.kernels.benchmark import _sdpa, decode_inputs
from asyncpaged.kernels.paged_attention import (
    AttentionConfig,
    choose_num_splits,
    paged_attention,
    plan_tiles,
)

SHAPES = [(1, 8192), (4, 4096), (16, 2048), (64, 1024), (256, 1024)]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def sweep_shape(batch: int, context: int) -> dict[str, Any]:
    """Time every tile config and split count at one decode shape; the best five and the default."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = HEADS // KV_HEADS
    inputs = decode_inputs(
        batch, context, num_heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype
    )
    query, meta, kv_bytes = inputs.query, inputs.meta, inputs.kv_bytes
    k_cache, v_cache = inputs.runner_views()
    kc = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=dev, dtype=dtype)
    sdpa_us = do_bench(_sdpa(query[:, :, None, :], kc, torch.randn_like(kc), g)) * 1e3
    del kc
    results = []
    for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (None, 1, 2, 4)):
        cfg = AttentionConfig(16, 16 // g, block_n, warps, stages)
        plan = plan_tiles([1] * batch, cfg.block_q, dev)
        auto = choose_num_splits(batch * KV_HEADS, context, block_n, dev)
        for splits in sorted({auto, min(16, auto * 2), min(16, auto * 4)}):

            def run(c: AttentionConfig = cfg, p: Any = plan, s: int = splits) -> torch.Tensor:
                return paged_attention(
                    query, k_cache, v_cache, **meta, num_splits=s, plan=p, config=c
                )

            try:
                ms = do_bench(run, warmup=10, rep=30)
            except Exception as e:  # a config Triton cannot compile
                print(f"  {cfg} splits {splits}: {type(e).__name__}: {e}"[:200], flush=True)
                continue
            results.append((ms * 1e3, block_n, warps, stages, splits, splits == auto))
    results.sort()
    default = next(r for r in results if r[1:4] == (64, 4, None) and r[5])
    best = results[0]
    gbps = kv_bytes / 1e3
    print(
        f"{batch:>4} x {context:>5}: sdpa {sdpa_us:7.1f} us ({gbps / sdpa_us:5.0f} GB/s) | "
        f"default {default[0]:7.1f} us ({gbps / default[0]:5.0f} GB/s) | "
        f"best {best[0]:7.1f} us ({gbps / best[0]:5.0f} GB/s)",
        flush=True,
    )
    for r in results[:5]:
        print(f"      {r[0]:7.1f} us  block_n {r[1]} warps {r[2]} stages {r[3]} splits {r[4]}")
    return {
        "batch": batch,
        "context": context,
        "sdpa_us": sdpa_us,
        "default_us": default[0],
        "kv_bytes": kv_bytes,
        "all": [list(r) for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [sweep_shape(batch, context) for batch, context in SHAPES]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
