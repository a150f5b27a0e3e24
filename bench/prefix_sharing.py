"""Shared-prefix throughput: requests that start with a one-shot or five-shot prefix, with
automatic prefix caching on and off (the paper's Fig. 16: 1.67x and 3.58x over its baseline).

    .venv/bin/python bench/prefix_sharing.py [--threads 1] [--requests 32]

A random Llama (hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 8000, float32, seeded) is
saved as a real checkpoint in a temporary folder and served by the engine. Each request is the
prefix plus a unique 16-token suffix, greedy, 16 new tokens, EOS ignored. Each configuration runs
in a fresh engine after a warm-up request; the prefix is not computed ahead of time (the first
requests compute it, the rest hit the cache).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import anyio
import torch

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.testing.tiny_models import build_tokenizer

SHOT_TOKENS = 80  # one "example" of the few-shot prefix


def build_model(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                         max_position_embeddings=1024, initializer_range=0.05)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    build_tokenizer().save_pretrained(str(directory))
    return directory


async def run_config(model: Path, prompts: list[list[int]], caching: bool) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    config = EngineConfig(model=str(model), dtype="float32", num_device_blocks=2048,
                          enable_prefix_caching=caching, max_num_batched_tokens=1024)  # fmt: skip
    async with AsyncEngine(config) as engine:
        await engine.generate([5, 6, 7], params)  # warm-up

        async def one(prompt: list[int]) -> None:
            await engine.generate(prompt, params)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(one, p)
        elapsed = time.perf_counter() - start
        hits = engine.statistics().prefix_cache_hit_tokens
    tokens = len(prompts) * params.max_tokens  # type: ignore[operator]
    print(f"    caching={caching!s:<5} {elapsed:6.2f} s  {tokens / elapsed:7.1f} tok/s  "
          f"prefix-hit tokens {hits}")  # fmt: skip
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp))
        print(f"torch threads {torch.get_num_threads()}, {args.requests} requests per run")
        for shots in (1, 5):
            prefix = [rng.randrange(4, 8000) for _ in range(shots * SHOT_TOKENS)]
            prompts = [prefix + [rng.randrange(4, 8000) for _ in range(16)]
                       for _ in range(args.requests)]  # fmt: skip
            print(f"{shots}-shot prefix ({len(prefix)} tokens):")
            off = anyio.run(run_config, model, prompts, False)
            on = anyio.run(run_config, model, prompts, True)
            print(f"    speed-up with prefix caching: {on / off:.2f}x")


if __name__ == "__main__":
    main()
