"""``asyncpaged bench speculative``: per-request latency with and without speculative decoding.

An input-grounded workload on the built-in model (or ``--model``): each prompt is a passage of
Python's reference manual (``pydoc_data.topics``, topics in sorted order) followed by its own
beginning again (cut where a word ends), so a continuation that copies the passage is what the
prompt invites (the shape of summarising and code editing, where the output repeats spans of
the input). Greedy, ``--max-tokens`` (128) new tokens, EOS ignored, every request a DELTA
stream.

Modes (``--modes``): ``off``; ``ngram`` (prompt lookup, ``--k`` proposals,
``--lookup-min``/``--lookup-max``); ``draft`` (``--draft-model DIR``, a smaller checkpoint with
the same tokenizer); each with ``+async`` or ``+sync`` to force ``async_scheduling`` (else
"auto"). For each batch size of ``--batches`` (1 and 8) the prompts run in waves of
that many concurrent requests; each request's TPOT is (last chunk - first chunk) / (tokens - 1)
as its client sees it (vLLM's definition); the run reports the median TPOT over requests and
the output tokens per second. ``--throughput-batch`` (64) runs that many at once for the
throughput cost. Every mode gets a fresh engine per run; runs are interleaved over
``--repeats`` and summarised by medians. Greedy tokens must be identical in every mode (a
digest per mode is printed and checked). ``--output DIR`` receives ``speculative.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import anyio

from asyncpaged.tools.bench_overhead import cpu_flags


def grounded_prompts(num: int, passage_chars: int = 700, echo_chars: int = 160) -> list[str]:
    """``num`` passages of the reference manual, each followed by its beginning again: its
    first ``echo_chars`` characters, cut back to the last space or newline. (A cut inside a
    word leaves a word piece the passage's own tokens do not contain, so neither the model nor
    a prompt lookup could continue the copy from there; a summary or an edited line never
    starts mid-word.)"""
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics) if len(topics[name]) >= passage_chars]
    out = []
    for text in texts[:num]:
        passage = text[:passage_chars]
        cut = max(passage.rfind(" ", 0, echo_chars), passage.rfind("\n", 0, echo_chars))
        out.append(f"{passage}\n\n{passage[: cut if cut > 0 else echo_chars]}")
    return out


# a mode's suffix: async_scheduling
LOOPS: dict[str, bool | Literal["auto"]] = {"": "auto", "async": True, "sync": False}


def _config(args: argparse.Namespace, mode: str) -> Any:
    from asyncpaged import EngineConfig, SpeculativeConfig, default_model

    mode, _, loop = mode.partition("+")
    if loop not in LOOPS:
        raise SystemExit(f"mode {mode}+{loop}: the suffix is +async or +sync")
    spec = None
    if mode == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k,
                                 prompt_lookup_min=args.lookup_min,
                                 prompt_lookup_max=args.lookup_max)  # fmt: skip
    elif mode == "draft":
        if not args.draft_model:
            raise SystemExit("mode 'draft' needs --draft-model DIR")
        spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=args.k,
                                 model=args.draft_model)  # fmt: skip
    model = args.model or str(default_model.path())
    return EngineConfig(model=model, speculative_config=spec, seed=0,
                        max_num_seqs=max(64, args.throughput_batch),
                        executor_backend=args.executor_backend,
                        async_scheduling=LOOPS[loop],
                        )  # fmt: skip


async def _run(args: argparse.Namespace, mode: str, prompts: list[str]) -> dict[str, Any]:
    from asyncpaged import AsyncEngine, RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    result: dict[str, Any] = {"mode": mode}
    tokens: dict[int, list[int]] = {}
    async with AsyncEngine(_config(args, mode)) as engine:
        await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))

        async def one(i: int, tpots: list[float]) -> None:
            chunks: list[float] = []
            ids: list[int] = []
            async for out in engine.generate(prompts[i], params):
                if out.outputs[0].token_ids:
                    chunks.append(time.perf_counter())
                    ids.extend(out.outputs[0].token_ids)
            tokens[i] = ids
            if len(ids) > 1:
                tpots.append((chunks[-1] - chunks[0]) / (len(ids) - 1))

        for batch in [*args.batches, args.throughput_batch]:
            tpots: list[float] = []
            began = time.perf_counter()
            num = len(prompts) if batch < args.throughput_batch else batch
            for wave in range(0, num, batch):
                async with anyio.create_task_group() as tg:
                    for i in range(wave, min(wave + batch, num)):
                        tg.start_soon(one, i % len(prompts), tpots)
            wall = time.perf_counter() - began
            result[f"batch_{batch}"] = {
                "tpot_ms": 1000 * statistics.median(tpots),
                "tokens_per_s": num * args.max_tokens / wall,
            }
        stats = engine.statistics()
    result["acceptance_rate"] = stats.num_accepted_tokens / max(1, stats.num_draft_tokens)
    result["tokens_per_round"] = 1 + stats.num_accepted_tokens / max(1, stats.num_drafts)
    result["acceptance_by_position"] = list(stats.spec_acceptance_by_position)
    ordered = [tokens[i] for i in sorted(tokens)]
    result["tokens_digest"] = hashlib.sha256(json.dumps(ordered).encode()).hexdigest()[:16]
    return result


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    prompts = grounded_prompts(args.num_prompts)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            runs[mode].append(anyio.run(_run, args, mode, prompts))
    keys = [f"batch_{b}" for b in [*args.batches, args.throughput_batch]]
    base = runs[args.modes[0]]
    print(
        f"CPU flags: {cpu_flags()}; {args.threads} torch thread(s); {len(prompts)} prompts, "
        f"{args.max_tokens} tokens, k={args.k}; medians of {args.repeats} interleaved runs"
    )
    summary: dict[str, Any] = {}
    for mode, rs in runs.items():
        row: dict[str, Any] = {}
        for key in keys:
            tpot = statistics.median(r[key]["tpot_ms"] for r in rs)
            tps = statistics.median(r[key]["tokens_per_s"] for r in rs)
            ref = statistics.median(r[key]["tpot_ms"] for r in base)
            row[key] = {"tpot_ms": tpot, "tokens_per_s": tps, "tpot_speedup": ref / tpot}
        row["acceptance_rate"] = rs[-1]["acceptance_rate"]
        row["tokens_per_round"] = rs[-1]["tokens_per_round"]
        summary[mode] = row
        cells = "  ".join(f"{k}: TPOT {v['tpot_ms']:.2f} ms ({v['tpot_speedup']:.2f}x), "
                          f"{v['tokens_per_s']:.0f} tok/s" for k, v in row.items()
                          if k.startswith("batch"))  # fmt: skip
        print(f"{mode:11s} {cells}  acceptance {row['acceptance_rate']:.2f}, "
              f"{row['tokens_per_round']:.2f} tokens/round")  # fmt: skip
    digests = {r["tokens_digest"] for rs in runs.values() for r in rs}
    same = len(digests) == 1
    print("greedy tokens identical in every mode and run" if same else
          f"TOKENS DIFFER: {sorted(digests)}")  # fmt: skip
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps(
        {"cpu_flags": cpu_flags(), "args": {k: v for k, v in vars(args).items()
                                             if k != "func"},
         "runs": runs, "summary": summary}, indent=2))  # fmt: skip
    return 0 if same else 1


def add_parser(modes: Any) -> None:
    p = modes.add_parser("speculative", help="latency with and without speculative decoding")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["off", "ngram"])
    p.add_argument("--model", default=None, help="target checkpoint (default: built-in model)")
    p.add_argument("--draft-model", default=None, help="draft checkpoint for mode 'draft'")
    p.add_argument("--k", type=int, default=4, help="proposals per step")
    p.add_argument("--lookup-min", type=int, default=1)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--throughput-batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--executor-backend", choices=("auto", "thread", "process"), default="auto",
                   help="where the model runner runs (EngineConfig.executor_backend)")  # fmt: skip
    p.add_argument("--output", default="bench-results", help="folder for speculative.json")
    p.set_defaults(func=run)
