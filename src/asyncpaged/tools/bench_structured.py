"""``asyncpaged bench structured``: the cost of a JSON-schema constraint against unconstrained,
and what jump-forward decoding gains.

The reference workload's tokenizer has no punctuation (its words are ``w4 .. w31999``), so no
JSON can be spelled with it: this benchmark runs the built-in model (a byte-level BPE over the
Python docs) instead. ``--num-requests`` prompts (the workload's seeded lengths over the built-in
vocabulary) each generate up to ``--max-tokens`` tokens, greedy, in one engine per run, in one
of three modes: ``free`` (unconstrained, EOS ignored: every request makes ``max_tokens``),
``json`` (a schema with long fixed keys, jump-forward off: it ends at the grammar's end) and
``json_jf`` (the same with ``structured_outputs_jump_forward=True``: the keys and punctuation
are appended without sampling); ``--engine-option KEY=VALUE`` sets other ``EngineConfig``
fields for every mode. Throughput is output tokens (forced ones included) per second
of wall time; runs alternate between the modes, ``--repeats`` times each, and medians are
reported with their spread and the ratios (goals: constrained >= 0.9x free; jump-forward on
above off). Constrained outputs are checked to parse as JSON. ``--output DIR`` receives
``structured.json``.
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

from asyncpaged.tools.proc_stats import engine_cpu_s

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


MODES = ("free", "json", "json_jf")


async def _one_run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from asyncpaged import AsyncEngine, EngineConfig, SamplingParams, StructuredOutputsParams
    from asyncpaged.tools.demo import default_model

    constrained = mode != "free"
    rng = random.Random(args.seed)
    prompts: list[list[int]] = []
    config = EngineConfig(model=default_model(), seed=args.seed,
                          structured_outputs_jump_forward=mode == "json_jf",
                          **dict(args.engine_option))  # fmt: skip
    async with AsyncEngine(config) as engine:
        vocab = engine.vocab_size
        for _ in range(args.num_requests):
            prompts.append([rng.randrange(4, vocab) for _ in range(rng.randint(16, 64))])
        constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not constrained,
            structured_outputs=constraint if constrained else None,
        )  # fmt: skip
        await engine.generate(prompts[0][:8], params)  # warm-up: compiles the grammar
        before = engine.statistics()
        outputs: list[Any] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc=mode, leave=False, disable=not args.progress)
        began, began_cpu = time.perf_counter(), engine_cpu_s(engine)

        async def one(i: int) -> None:
            outputs[i] = (await engine.generate(prompts[i], params)).outputs[0]
            bar.update(1)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        wall, cpu = time.perf_counter() - began, engine_cpu_s(engine) - began_cpu
        bar.close()
        after = engine.statistics()
    tokens = sum(len(o.token_ids) for o in outputs)
    stopped = [o for o in outputs if o.finish_reason == "stop"] if constrained else []
    return {
        "mode": mode,
        "constrained": constrained,
        "wall_s": wall,
        "cpu_s": cpu,  # the engine's processes' CPU time (tools/proc_stats.py): steadier than wall
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "req_per_s": len(prompts) / wall,
        "tok_per_cpu_s": tokens / cpu,
        "num_steps": after.num_steps - before.num_steps,
        "num_jump_forward_tokens": after.num_jump_forward_tokens - before.num_jump_forward_tokens,
        "num_stopped": len(stopped),
        "num_valid_json": sum(_parses(o.text) for o in stopped),
        "texts": [o.text for o in stopped],
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _summary(runs: list[dict[str, Any]], mode: str) -> dict[str, float]:
    mine = [r for r in runs if r["mode"] == mode]
    out: dict[str, float] = {"median_steps": statistics.median(r["num_steps"] for r in mine)}
    for key in ("tok_per_s", "req_per_s", "tok_per_cpu_s"):
        values = [r[key] for r in mine]
        out.update({f"median_{key}": statistics.median(values), f"min_{key}": min(values),
                    f"max_{key}": max(values)})  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for mode in MODES:
            runs.append(anyio.run(_one_run, args, mode))
    summary = {mode: _summary(runs, mode) for mode in MODES}
    median = {mode: summary[mode]["median_tok_per_s"] for mode in MODES}
    requests = {mode: summary[mode]["median_req_per_s"] for mode in MODES}
    ratios = {
        "json_vs_free": median["json"] / median["free"],
        "json_jf_vs_free": median["json_jf"] / median["free"],
        "jump_forward_on_vs_off": median["json_jf"] / median["json"],
        "jump_forward_on_vs_off_req_per_s": requests["json_jf"] / requests["json"],
    }
    checked = [r for r in runs if r["constrained"]]
    stopped = sum(r["num_stopped"] for r in checked)
    valid = sum(r["num_valid_json"] for r in checked)
    # greedy: every run of a mode writes the same JSON
    same = all(len({tuple(r["texts"]) for r in checked if r["mode"] == m}) == 1
               for m in ("json", "json_jf"))  # fmt: skip
    for mode in MODES:
        m = summary[mode]
        print(
            f"{mode:8s} {m['median_tok_per_s']:8.1f} tok/s (median; {m['min_tok_per_s']:.1f}"
            f"-{m['max_tok_per_s']:.1f}), {m['median_req_per_s']:.2f} requests/s, "
            f"{m['median_tok_per_cpu_s']:.1f} tok per CPU s, {m['median_steps']:.0f} steps"
        )
    print(
        f"json / free {ratios['json_vs_free']:.2f}x, json + jump-forward / free "
        f"{ratios['json_jf_vs_free']:.2f}x (goal >= 0.9); jump-forward on / off "
        f"{ratios['jump_forward_on_vs_off']:.2f}x tok/s, "
        f"{ratios['jump_forward_on_vs_off_req_per_s']:.2f}x requests/s; {valid} of {stopped} "
        f"finished outputs parse{'' if same else '; the JSON of one mode differs between runs'}"
    )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for r in runs:
        r.pop("texts")
    (out / "structured.json").write_text(json.dumps(
        {"schema": SCHEMA, "runs": runs, "summary": summary, "median_tok_per_s": median,
         "ratios": ratios, "ratio": ratios["json_jf_vs_free"], "same_json": same},
        indent=2))  # fmt: skip
    return 0 if valid == stopped else 1


def add_parser(modes: Any) -> None:
    from asyncpaged.tools.bench_throughput import engine_option

    p = modes.add_parser(
        "structured", help="JSON-schema constrained vs free generation, jump-forward on and off"
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160, help="the schema's JSON needs ~100")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench-results", help="folder for structured.json")
    p.add_argument("--engine-option", type=engine_option, action="append", default=[],
                   metavar="KEY=VALUE",
                   help="an EngineConfig field (repeatable): async_scheduling=false")  # fmt: skip
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)
