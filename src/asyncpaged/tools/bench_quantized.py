"""``asyncpaged bench quantized``: GGUF weights through the engine, against its own float runs
and llama.cpp on the same files, interleaved, medians.

A random model of ``--shape`` is written as GGUF once per type (``testing/tiny_gguf.py``:
Q8_0 and Q4_0 quantized from the weights, K-quants as random valid blocks; with
``--llama-cpp BUILD_DIR``, ``Q4_K_M``, ``Q4_0`` and ``Q8_0`` are made from the F32 file by
llama.cpp's own ``llama-quantize``, with its choice of type per tensor), and as a transformers
checkpoint for the ``float32`` / ``bfloat16`` runs. The shapes are the real models' (the
vocabulary too: the tiny tokenizer padded with unused tokens, and tied embeddings), so the LM
head and the embedding cost what they cost in the real model. ``--shape mid`` and ``tiny`` keep
the tiny vocabulary.

A type written ``Q4_K_M:int8`` runs the engine on that file with ``quantized_activations="int8"``
(llama.cpp's way of multiplying; llama.cpp runs each file once).

Each configuration runs in a fresh process (``--threads`` torch threads), each round visiting
every configuration in turn: decode (one request, ``--new-tokens`` tokens), batch (``--batch``
concurrent requests of ``--new-tokens``), prefill (one prompt of ``--prompt-tokens``, one new
token). llama.cpp's figures come from ``llama-bench`` (prefill ``pp``, decode ``tg``) and
``llama-batched-bench`` (``--batch`` parallel sequences). ``quantized.json`` holds every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-0.6B's shape (28 layers of hidden 1024, its vocabulary, tied embeddings)
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936, "tie_word_embeddings": True},
    # Llama-3.2-1B's (16 layers of hidden 2048)
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "vocab_size": 128256, "tie_word_embeddings": True},
    "mid": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    # (a Qwen3 GGUF states no head_dim that transformers reads: 128, Qwen3Config's default)
    "tiny": {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128},
}  # fmt: skip
FLOAT_TYPES = ("float32", "bfloat16")


def _base(shape: str) -> str:
    return "llama-gqa" if shape.startswith("llama") else "qwen3"


def build_files(
    shape: str, types: list[str], folder: Path, llama_cpp: Path | None
) -> dict[str, Path]:
    """The model files of every type (written once into ``folder``)."""
    from asyncpaged.testing import tiny_gguf

    folder.mkdir(parents=True, exist_ok=True)
    name = f"bench-{shape}"
    tiny_gguf.TINY_GGUF_MODELS[name] = (
        _base(shape),
        {**SHAPES[shape], "max_position_embeddings": 4096},
    )
    files: dict[str, Path] = {}
    f32 = folder / f"{shape}-F32.gguf"
    if not f32.exists():
        tiny_gguf.write_tiny_gguf(name, f32, default="F32")
    for qtype in types:
        if qtype in FLOAT_TYPES:
            hf = folder / f"{shape}-hf"
            if not hf.exists():
                _save_transformers(f32, hf)
            files[qtype] = hf
            continue
        path = folder / f"{shape}-{qtype}.gguf"
        if not path.exists():
            if llama_cpp is not None and qtype in ("Q4_K_M", "Q4_0", "Q8_0"):
                subprocess.run([str(llama_cpp / "bin" / "llama-quantize"), str(f32), str(path),
                                qtype], check=True, capture_output=True)  # fmt: skip
            elif qtype == "Q4_K_M":
                raise SystemExit("Q4_K_M needs llama.cpp's llama-quantize (--llama-cpp).")
            else:
                tiny_gguf.write_tiny_gguf(name, path, default=qtype)
        files[qtype] = path
    return files


def _save_transformers(f32: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    from asyncpaged.testing.tiny_gguf import load_transformers_gguf

    load_transformers_gguf(f32).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(f32.parent), gguf_file=f32.name).save_pretrained(str(folder))


def measure(model: str, dtype: str, threads: int, new_tokens: int, batch: int,
            prompt_tokens: int, activations: str = "float32") -> dict[str, float]:  # fmt: skip
    """One configuration in this process: decode, batch and prefill tok/s, and RSS;
    ``activations``: the engine's ``quantized_activations``."""
    import anyio
    import torch

    from asyncpaged import AsyncEngine, EngineConfig, SamplingParams

    if activations not in ("float32", "int8"):
        raise ValueError(f"activations must be 'float32' or 'int8', got {activations!r}.")
    mode: Literal["float32", "int8"] = "int8" if activations == "int8" else "float32"
    torch.set_num_threads(threads)

    async def main() -> dict[str, float]:
        config = EngineConfig(model=model, dtype=dtype, executor_backend="thread",
                              kv_cache_bytes=256 << 20, seed=0,
                              quantized_activations=mode)  # fmt: skip
        async with AsyncEngine(config) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
            start = time.perf_counter()
            await engine.generate([5, 6, 7, 8], params)
            decode = new_tokens / (time.perf_counter() - start)

            async def one(i: int) -> None:
                await engine.generate([5 + i, 6, 7], params)

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(batch):
                    tg.start_soon(one, i)
            batched = batch * new_tokens / (time.perf_counter() - start)
            prompt = [(7 * i) % 300 + 4 for i in range(prompt_tokens)]
            start = time.perf_counter()
            await engine.generate(prompt, SamplingParams(max_tokens=1))
            prefill = prompt_tokens / (time.perf_counter() - start)
        return {"decode": decode, "batch": batched, "prefill": prefill, "rss_mib": _rss_mib()}

    return anyio.run(main)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def llama_cpp_run(build: Path, model: Path, threads: int, new_tokens: int, batch: int,
                  prompt_tokens: int) -> dict[str, float]:  # fmt: skip
    """llama.cpp on the same file: llama-bench's pp and tg, llama-batched-bench's batch."""
    bench = subprocess.run(
        [str(build / "bin" / "llama-bench"), "-m", str(model), "-t", str(threads), "-p",
         str(prompt_tokens), "-n", str(new_tokens), "-r", "1", "-o", "json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    rows = json.loads(bench.stdout)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    batched = subprocess.run(
        [str(build / "bin" / "llama-batched-bench"), "-m", str(model), "-t", str(threads),
         "-npp", "3", "-ntg", str(new_tokens), "-npl", str(batch),
         "-c", str(batch * (new_tokens + 8))],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return {"decode": decode, "batch": _batched_tg(batched.stdout), "prefill": prefill}


def _batched_tg(text: str) -> float:
    """S_TG t/s of llama-batched-bench's table (its 8th column)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0]):
            return float(cells[7])
    raise RuntimeError(f"no llama-batched-bench result in:\n{text[-2000:]}")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    types = [t for t in args.types.split(",") if t]  # "Q4_K_M:int8": int8 activations
    file_types = list(dict.fromkeys(t.partition(":")[0] for t in types))
    llama_cpp = Path(args.llama_cpp) if args.llama_cpp else None
    files = build_files(args.shape, file_types, Path(args.files), llama_cpp)
    configs = [("asyncpaged", t) for t in types]
    if llama_cpp is not None:
        configs += [("llama.cpp", t) for t in file_types if t not in FLOAT_TYPES]
    results: dict[str, list[dict[str, float]]] = {f"{e} {t}": [] for e, t in configs}
    with tqdm(total=args.rounds * len(configs), desc="bench quantized", unit="run") as bar:
        for _ in range(args.rounds):
            for engine, qtype in configs:
                if engine == "llama.cpp":
                    assert llama_cpp is not None
                    got = llama_cpp_run(llama_cpp, files[qtype], args.threads, args.new_tokens,
                                        args.batch, args.prompt_tokens)  # fmt: skip
                else:
                    file_type, _, activations = qtype.partition(":")
                    got = _subprocess(args, str(files[file_type]),
                                      file_type if file_type in FLOAT_TYPES else "float32",
                                      activations or "float32")  # fmt: skip
                results[f"{engine} {qtype}"].append(got)
                bar.update()
    print(f"shape {args.shape}, {args.threads} thread(s), {args.rounds} rounds (medians, tok/s)")
    print(f"{'engine':<28}{'decode':>10}{'batch':>10}{'prefill':>10}")
    medians = {}
    for key, runs in results.items():
        med = {m: statistics.median(r[m] for r in runs) for m in ("decode", "batch", "prefill")}
        medians[key] = med
        print(f"{key:<28}{med['decode']:>10.1f}{med['batch']:>10.1f}{med['prefill']:>10.1f}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    report = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
              "cpu": _cpu(), "runs": results, "medians": medians}  # fmt: skip
    (out / "quantized.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _subprocess(
    args: argparse.Namespace, model: str, dtype: str, activations: str
) -> dict[str, float]:
    code = (
        "import json, sys; from asyncpaged.tools.bench_quantized import measure; "
        f"print(json.dumps(measure({model!r}, {dtype!r}, {args.threads}, {args.new_tokens}, "
        f"{args.batch}, {args.prompt_tokens}, {activations!r})))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, env=env)  # fmt: skip
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _cpu() -> str:
    with open("/proc/cpuinfo") as info:
        return next((line.split(":", 1)[1].strip() for line in info
                     if line.startswith("model name")), "unknown")  # fmt: skip


def add_parser(modes: Any) -> None:
    p = modes.add_parser("quantized", help="GGUF weights: the engine against float and llama.cpp")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--types", default="Q8_0,Q4_0,bfloat16,float32",
                   help="comma-separated: GGUF types (Q4_K_M needs --llama-cpp; TYPE:int8 "
                   "runs the engine with int8 activations), float32, bfloat16")  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--llama-cpp", help="a llama.cpp build folder (bin/llama-bench, ...)")
    p.add_argument(
        "--files", default=str(Path.home() / ".cache" / "asyncpaged" / "bench-quantized")
    )
    p.add_argument("--output", default="bench-results", help="folder for quantized.json")
    p.set_defaults(func=run)
