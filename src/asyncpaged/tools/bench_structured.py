"""``asyncpaged bench structured``: the cost of a JSON-schema constraint against unconstrained.

The reference workload's tokenizer has no punctuation (its words are ``w4 .. w31999``), so no
JSON can be spelled with it: this benchmark runs the built-in model (a byte-level BPE over the
Python docs) instead. ``--num-requests`` prompts (the workload's seeded lengths over the built-in
vocabulary) each generate up to ``--max-tokens`` tokens, greedy, in one engine per run; a run is
either unconstrained (EOS ignored, every request makes ``max_tokens``) or constrained by a
schema with long fixed keys (it ends at the grammar's end). Throughput is output tokens
actually generated per second of wall time; runs alternate between the two modes,
``--repeats`` times each, and medians are reported with their ratio (goal >= 0.9x).
Constrained outputs are checked to parse as JSON. Jump-forward decoding is not implemented
yet: its gain is not measured here. ``--output DIR`` receives ``structured.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
from tqdm import tqdm  # type: ignore[import-untyped]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "statement_kind_of_the_python_language": {"enum": ["simple", "compound"]},
        "introduced_in_python_version_number": {"type": "integer", "minimum": 0, "maximum": 9},
        "related_keywords_in_the_grammar": {
            "type": "array",
            "items": {"enum": ["return", "yield", "with", "if"]},
            "maxItems": 3,
        },
    },
    "required": [
        "statement_kind_of_the_python_language",
        "introduced_in_python_version_number",
        "related_keywords_in_the_grammar",
    ],
    "additionalProperties": False,
}


async def _one_run(args: argparse.Namespace, constrained: bool) -> dict[str, Any]:
    from asyncpaged import AsyncEngine, EngineConfig, SamplingParams, StructuredOutputsParams
    from asyncpaged.tools.demo import default_model

    rng = random.Random(args.seed)
    prompts: list[list[int]] = []
    async with AsyncEngine(EngineConfig(model=default_model(), seed=args.seed)) as engine:
        vocab = engine.vocab_size
        for _ in range(args.num_requests):
            prompts.append([rng.randrange(4, vocab) for _ in range(rng.randint(16, 64))])
        constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not constrained,
            structured_outputs=constraint if constrained else None,
        )  # fmt: skip
        await engine.generate(prompts[0][:8], params)  # warm-up: compiles the grammar
        outputs: list[Any] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="structured" if constrained else "free",
                   leave=False, disable=not args.progress)  # fmt: skip
        began = time.perf_counter()

        async def one(i: int) -> None:
            outputs[i] = (await engine.generate(prompts[i], params)).outputs[0]
            bar.update(1)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        wall = time.perf_counter() - began
        bar.close()
    tokens = sum(len(o.token_ids) for o in outputs)
    stopped = [o for o in outputs if o.finish_reason == "stop"] if constrained else []
    return {"constrained": constrained, "wall_s": wall, "tokens": tokens,
            "tok_per_s": tokens / wall, "num_stopped": len(stopped),
            "num_valid_json": sum(_parses(o.text) for o in stopped)}  # fmt: skip


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for constrained in (False, True):
            runs.append(anyio.run(_one_run, args, constrained))
    free = statistics.median(r["tok_per_s"] for r in runs if not r["constrained"])
    bound = statistics.median(r["tok_per_s"] for r in runs if r["constrained"])
    checked = [r for r in runs if r["constrained"]]
    stopped = sum(r["num_stopped"] for r in checked)
    valid = sum(r["num_valid_json"] for r in checked)
    print(
        f"unconstrained {free:.1f} tok/s, json schema {bound:.1f} tok/s: ratio "
        f"{bound / free:.2f}x (goal >= 0.9); {valid} of {stopped} finished outputs parse"
    )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(
        {"schema": SCHEMA, "runs": runs, "median_tok_per_s": {"free": free, "json": bound},
         "ratio": bound / free}, indent=2))  # fmt: skip
    return 0 if valid == stopped else 1


def add_parser(modes: Any) -> None:
    p = modes.add_parser("structured", help="JSON-schema constrained vs free generation")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160, help="the schema's JSON needs ~100")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench-results", help="folder for structured.json")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)
