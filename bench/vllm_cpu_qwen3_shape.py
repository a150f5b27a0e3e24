"""A Qwen3-0.6B-shaped bfloat16 model against vLLM's CPU build: the reference workload's toy
model (8 heads x 64, vocabulary 32000) is not how real models' costs split (docs/benchmarks.md).

A Llama with Qwen3-0.6B's widths (hidden 1024, 16/8 heads x 128, intermediate 3072, vocabulary
151936, tied embeddings) and 8 of its 28 layers, random bf16 weights, 16 requests (prompts
64-512, 32-64 new tokens, greedy, EOS ignored), written in ``vllm_cpu.py``'s export format::

    .venv/bin/python bench/vllm_cpu_qwen3_shape.py export /tmp/qwen3-shape      # ~1 min
    .venv/bin/python bench/vllm_cpu_qwen3_shape.py compare /tmp/qwen3-shape --rounds 3 \\
        [--tree NAME=SRC_DIR ...] [--vllm-python /tmp/vllmenv/bin/python]

``compare`` interleaves fresh processes: each asyncpaged tree (1 torch thread, the bench's
malloc settings) and ``vllm_cpu.py run`` (its settings), and prints tok/s per round, medians and
ratios to vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_cpu import _vllm_round  # noqa: E402  (this folder's sibling script)


def export(directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncpaged.tools.bench_workload import NUM_SPECIAL, build_word_tokenizer

    torch.set_num_threads(1)
    checkpoint = directory / "checkpoint"
    config = LlamaConfig(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=2048,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(checkpoint))
    build_word_tokenizer(config.vocab_size).save_pretrained(str(checkpoint))
    rng = random.Random(0)
    prompts, max_tokens = [], []
    for _ in range(16):
        length = rng.randint(64, 512)
        prompts.append([rng.randrange(NUM_SPECIAL, config.vocab_size) for _ in range(length)])
        max_tokens.append(rng.randint(32, 64))
    model = LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    hf_tokens = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)  # fmt: skip
            hf_tokens.append(out[0, len(prompt) :].tolist())
    workload = {"prompts": prompts, "max_tokens": max_tokens, "dtype": "bfloat16"}
    (directory / "workload.json").write_text(json.dumps(workload))
    (directory / "hf_tokens.json").write_text(json.dumps(hf_tokens))
    print(f"exported {sum(max_tokens)} output tokens, {sum(map(len, prompts))} prompt tokens")


def run_asyncpaged(directory: Path) -> None:
    """One timed pass of asyncpaged over the workload (this process), after a warm-up request."""
    import anyio
    import torch

    from asyncpaged import AsyncEngine, EngineConfig, SamplingParams

    torch.set_num_threads(1)
    workload = json.loads((directory / "workload.json").read_text())
    want = json.loads((directory / "hf_tokens.json").read_text())
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    blocks = sum(math.ceil((len(p) + n) / 16) + 1 for p, n in zip(prompts, max_tokens, strict=True))
    config = EngineConfig(model=str(directory / "checkpoint"), dtype="bfloat16", block_size=16,
                          num_device_blocks=blocks, max_num_seqs=256,
                          max_num_batched_tokens=2048)  # fmt: skip
    got: list[list[int]] = [[] for _ in prompts]

    async def main() -> float:
        async with AsyncEngine(config) as engine:
            warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            await engine.generate([5, 6, 7], warm)
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):

                    async def one(i: int = i) -> None:
                        params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                                ignore_eos=True)  # fmt: skip
                        out = await engine.generate(prompts[i], params)
                        got[i] = list(out.outputs[0].token_ids)

                    tg.start_soon(one)
            return time.perf_counter() - start

    wall = anyio.run(main)
    matched = sum(g == w for g, w in zip(got, want, strict=True))
    print(f"asyncpaged: {sum(max_tokens) / wall:.1f} tok/s ({wall:.2f} s), "
          f"{matched}/{len(want)} requests equal transformers'")  # fmt: skip


def compare(directory: Path, rounds: int, trees: list[str], vllm_python: Path | None) -> None:
    from asyncpaged.tools.malloc_tuning import MALLOC_ENV

    named = [tuple(t.split("=", 1)) for t in trees] or [("installed", "")]
    rates: dict[str, list[float]] = {name: [] for name, _ in named}
    runners = [*named, *((("vllm", ""),) if vllm_python is not None else ())]
    for r in range(rounds):
        k = r % len(runners)
        for name, src in runners[k:] + runners[:k]:
            if name == "vllm":
                assert vllm_python is not None
                rate, _ = _vllm_round(directory, vllm_python)
            else:
                env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1",
                       "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
                if src:
                    env["PYTHONPATH"] = src
                done = subprocess.run([sys.executable, __file__, "run", str(directory)], env=env,
                                      check=True, capture_output=True, text=True)  # fmt: skip
                line = next(x for x in done.stdout.splitlines() if x.startswith("asyncpaged:"))
                rate = float(line.split()[1])
            rates.setdefault(name, []).append(rate)
            print(f"round {r + 1} {name}: {rate:.1f} tok/s", flush=True)
    base = statistics.median(rates["vllm"]) if rates.get("vllm") else None
    for name, values in rates.items():
        median = statistics.median(values)
        ratio = f", {median / base:.2f}x vllm" if base and name != "vllm" else ""
        print(f"{name}: median {median:.1f} tok/s{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["export", "run", "compare"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], help="NAME=SRC_DIR")
    parser.add_argument("--vllm-python", type=Path, default=Path("/tmp/vllmenv/bin/python"))
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    if args.command == "export":
        args.directory.mkdir(parents=True, exist_ok=True)
        export(args.directory)
    elif args.command == "run":
        run_asyncpaged(args.directory)
    else:
        compare(args.directory, args.rounds, args.tree, None if args.no_vllm else args.vllm_python)


if __name__ == "__main__":
    main()
