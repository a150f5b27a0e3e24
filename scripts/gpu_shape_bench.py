"""The engine on a real model's shapes, on CUDA (stage 6 of scripts/gpu_check.sh).

The built-in model is too small to show the GPU's work (head dim 32, host-bound). This builds a
Qwen3-0.6B-shaped Llama (hidden 1024, 16/8 heads x 128, intermediate 3072, vocabulary 151936,
tied embeddings; random bf16 weights, ``--layers`` of its 28) in a temporary directory, then
times the engine with its defaults (the KV cache sized by ``gpu_memory_utilization``, CUDA
graphs, the runner's process with async scheduling) on ``--requests`` greedy requests (prompts
of 128-1024 tokens, ``--max-tokens`` new ones, EOS ignored), each run in a fresh process, the
Triton backend's cache in the NHD layout and in the runner layout
(``ASYNCPAGED_TRITON_KV_LAYOUT``), rounds interleaved. Prints tok/s per run, the medians, the
ratio, and the KV cache the budget gave (``kv_budget``); ``--out`` writes them as JSON.

``python scripts/gpu_shape_bench.py [--rounds 2] [--out results.json]``;
``--device cpu --layers 1 --requests 4 --max-tokens 4`` rehearses it on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = ("nhd", "runner")


def build(directory: Path, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncpaged.tools.bench_workload import build_word_tokenizer

    config = LlamaConfig(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_theta=1000000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(directory))
    build_word_tokenizer(config.vocab_size).save_pretrained(str(directory))
    return directory


def run_once(checkpoint: Path, device: str, requests: int, max_tokens: int) -> None:
    """One timed pass in this process (the layout comes from the environment); prints a JSON
    line: tok/s, seconds, steps, device blocks."""
    import anyio
    from structlog.testing import capture_logs

    from asyncpaged import AsyncEngine, EngineConfig, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(4, 151936) for _ in range(rng.randint(128, 1024))]
               for _ in range(requests)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    config = EngineConfig(model=str(checkpoint), dtype="bfloat16", device=device,
                          max_num_seqs=256, max_num_batched_tokens=4096,
                          max_model_len=2048)  # fmt: skip

    async def main() -> dict[str, float]:
        with capture_logs() as logs:
            engine = await AsyncEngine.start(config)
        try:
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
            before = engine.statistics()
            start = time.perf_counter()

            async def one(prompt: list[int]) -> None:
                await engine.generate(prompt, params)

            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(one, prompt)
            wall = time.perf_counter() - start
            stats = engine.statistics()
        finally:
            await engine.aclose()
        budget = next((e for e in logs if e["event"] == "kv_budget"), {})
        return {"tok_s": requests * max_tokens / wall, "seconds": wall,
                "steps": stats.num_steps - before.num_steps,
                "graph_steps": stats.num_cuda_graph_steps - before.num_cuda_graph_steps,
                "blocks": engine.num_device_blocks,
                "kv_cache_gib": budget.get("kv_cache_gib", 0.0)}  # fmt: skip

    print(json.dumps(anyio.run(main)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # a child: one pass over this checkpoint
    args = parser.parse_args()
    if args.run:
        run_once(Path(args.run), args.device, args.requests, args.max_tokens)
        return
    results: dict[str, list[dict[str, float]]] = {layout: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        checkpoint = build(Path(tmp), args.layers)
        print(f"built a Qwen3-0.6B-shaped model, {args.layers} layers, in "
              f"{time.perf_counter() - began:.0f} s", flush=True)  # fmt: skip
        for r in range(args.rounds):
            for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                env = {**os.environ, "ASYNCPAGED_TRITON_KV_LAYOUT": layout}
                done = subprocess.run(
                    [sys.executable, __file__, "--run", str(checkpoint), "--device", args.device,
                     "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)],
                    env=env, check=True, capture_output=True, text=True,
                )  # fmt: skip
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results[layout].append(result)
                print(f"round {r + 1} {layout}: {result['tok_s']:.0f} tok/s "
                      f"({result['seconds']:.2f} s, {result['steps']} steps, "
                      f"{result['graph_steps']} graphed, {result['blocks']} blocks = "
                      f"{result['kv_cache_gib']} GiB by the budget)", flush=True)  # fmt: skip
    medians = {k: statistics.median(r["tok_s"] for r in v) for k, v in results.items()}
    print(f"6. Qwen3-0.6B shape, {args.layers} layers, {args.requests} requests x "
          f"{args.max_tokens} tokens, bf16: NHD {medians['nhd']:.0f} tok/s, runner layout "
          f"{medians['runner']:.0f} tok/s ({medians['nhd'] / medians['runner']:.2f}x)")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
