"""``asyncpaged bench throughput``: asyncpaged against transformers on the reference workload.

Every engine (see :mod:`asyncpaged.tools.bench_engines`) runs in a fresh worker process with the
same environment and torch thread count; ``--repeats N`` runs them round-robin N times (the
starting engine rotates) and reports medians. Each engine's tokens are checked, request by
request, against ``hf-single`` (transformers ``generate`` one request at a time): the summary says
whether all matched and, if not, the first differing request and position.

Output tokens/s is the workload's requested output tokens (the sum of ``max_tokens``) over the
timed wall time. Targets: asyncpaged / hf-static-64 >= 2.2, asyncpaged / hf-cb >= 4, asyncpaged
setup < 2 s. ``--output DIR`` receives ``throughput.json`` (workload, machine, settings, every
run's raw numbers and tokens, medians) and ``throughput.png`` (needs matplotlib). The exit status
is 1 if an engine failed or any tokens differed, else 0 (a missed target is reported, not fatal).

The table's ``kv dtype`` column is the KV cache each engine stores (``--engine-option
kv_cache_dtype=int8`` sets asyncpaged's; "auto": the model's dtype). A quantized cache (int8,
fp8) rounds K and V, so its tokens are not checked against ``hf-single``'s unquantized cache (the
tests check them against transformers with K/V rounded the same way; ``bench kv-accuracy``
measures the difference).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncpaged.tools.bench_engines import (
    ENGINES,
    REFERENCE_ENGINE,
    EngineRun,
    WorkerSpec,
    run_engines,
)
from asyncpaged.tools.bench_workload import Workload, build_checkpoint, make_workload
from asyncpaged.tools.plotting import pyplot, save_report

TARGETS = (  # (name, engine the ratio is taken against or None for setup, target)
    ("asyncpaged / hf-static-64 tok/s", "hf-static-64", 2.2),
    ("asyncpaged / hf-cb tok/s", "hf-cb", 4.0),
)
SETUP_TARGET_S = 2.0
DEFAULT_CACHE = Path("~/.cache/asyncpaged/bench")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenCheck:
    """One engine run's tokens against the reference, request by request."""

    num_requests: int
    num_mismatched: int
    first_request: int | None = None  # the first differing request, and the first position in it
    first_position: int | None = None
    expected: int | None = None  # None: the reference (or the run) has no token there
    got: int | None = None

    @property
    def is_match(self) -> bool:
        return self.num_mismatched == 0

    def describe(self) -> str:
        if self.is_match:
            return f"all {self.num_requests} requests match"
        return (
            f"{self.num_mismatched}/{self.num_requests} requests differ; first: request "
            f"{self.first_request} position {self.first_position} "
            f"(expected {self.expected}, got {self.got})"
        )


def compare_tokens(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> TokenCheck:
    """Compare per request; a missing request or a shorter output counts as a difference."""
    num = max(len(reference), len(candidate))
    mismatched = [
        i
        for i in range(num)
        if i >= len(reference) or i >= len(candidate) or list(reference[i]) != list(candidate[i])
    ]
    if not mismatched:
        return TokenCheck(num_requests=num, num_mismatched=0)
    first = mismatched[0]
    ref = reference[first] if first < len(reference) else ()
    got = candidate[first] if first < len(candidate) else ()
    pos = next(
        (j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
        min(len(ref), len(got)),
    )
    return TokenCheck(
        num_requests=num,
        num_mismatched=len(mismatched),
        first_request=first,
        first_position=pos,
        expected=ref[pos] if pos < len(ref) else None,
        got=got[pos] if pos < len(got) else None,
    )


def check_runs(
    runs: Sequence[EngineRun], unchecked: Sequence[str] = ()
) -> dict[tuple[str, int], TokenCheck | None]:
    """Each successful run against the first successful ``hf-single`` run (None: no reference,
    or an engine in ``unchecked``)."""
    reference = next((r for r in runs if r.engine == REFERENCE_ENGINE and r.error is None), None)
    return {
        (r.engine, r.repeat): compare_tokens(reference.tokens, r.tokens)
        if reference is not None and r.error is None and r.engine not in unchecked
        else None
        for r in runs
    }


def kv_cache_dtype_of(engine: str, settings: dict[str, Any]) -> str:
    """The KV dtype ``engine`` stores: asyncpaged's ``kv_cache_dtype`` engine option, else
    "auto" (the model's dtype)."""
    if engine != "asyncpaged":
        return "auto"
    return str(settings.get("engine_options", {}).get("kv_cache_dtype", "auto"))


# ---- summary, table, plot -------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    from asyncpaged.model.cpu_plan import CpuFeatures

    cpu = CpuFeatures.detect()
    return {
        "cpu_model": cpu.model_name,
        "cpu_flags": list(cpu.vector_flags()),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def summarize(
    workload: Workload, runs: Sequence[EngineRun], settings: dict[str, Any], machine: dict[str, Any]
) -> dict[str, Any]:
    """The JSON document: raw runs, per-engine medians, token checks and targets."""
    from asyncpaged.model.kv_quant import KV_QUANT_DTYPES

    kv_dtypes = {e: kv_cache_dtype_of(e, settings) for e in dict.fromkeys(r.engine for r in runs)}
    unchecked = [e for e, kv in kv_dtypes.items() if kv in KV_QUANT_DTYPES]
    checks = check_runs(runs, unchecked)
    raw: list[dict[str, Any]] = []
    for r in runs:
        check = checks[(r.engine, r.repeat)]
        raw.append(
            {
                "engine": r.engine,
                "kv_cache_dtype": kv_dtypes[r.engine],
                "unchecked": r.engine in unchecked,
                "repeat": r.repeat,
                "error": r.error,
                "tok_per_s": workload.output_tokens / r.wall_s if r.wall_s else None,
                "wall_s": r.wall_s,
                "setup_s": r.setup_s,
                "peak_rss_mib": r.peak_rss_mib,
                "threads": r.threads,
                "settings": r.settings,
                "profile": r.profile,
                "match": None if check is None else check.is_match,
                "check": None if check is None else check.describe(),
                "tokens": [list(t) for t in r.tokens],
            }
        )
    medians: dict[str, dict[str, Any]] = {}
    for engine in dict.fromkeys(r.engine for r in runs):
        ok = [x for x in raw if x["engine"] == engine and x["error"] is None]
        matches = [x["match"] for x in raw if x["engine"] == engine]
        medians[engine] = {
            "num_runs": len(ok),
            "kv_cache_dtype": kv_dtypes[engine],
            **{
                k: statistics.median(x[k] for x in ok) if ok else None
                for k in ("tok_per_s", "wall_s", "setup_s", "peak_rss_mib")
            },
            "match": None if None in matches else all(matches),
        }
    checked = [x for x in raw if not x["unchecked"]]
    return {
        "workload": describe_workload(workload),
        "machine": machine,
        "settings": settings,
        "runs": raw,
        "medians": medians,
        "targets": targets(medians),
        # None: nothing to check against (the reference engine did not run)
        "all_matched": (
            bool(checked) and all(x["match"] is True for x in checked)
            if any(r.engine == REFERENCE_ENGINE and r.error is None for r in runs)
            else None
        ),
    }


def describe_workload(workload: Workload) -> dict[str, Any]:
    return {
        "name": workload.name,
        "description": workload.describe(),
        "seed": workload.seed,
        "num_requests": workload.num_requests,
        "output_tokens": workload.output_tokens,
        "prompt_lens": [len(p) for p in workload.prompts],
        "max_tokens": list(workload.max_tokens),
        "model_config": workload.model_config,
    }


def targets(medians: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    ours = medians.get("asyncpaged", {})
    found = []
    for name, other, target in TARGETS:
        theirs = medians.get(other, {}).get("tok_per_s")
        if ours.get("tok_per_s") and theirs:
            value = ours["tok_per_s"] / theirs
            found.append(
                {"name": name, "value": value, "target": f">= {target}", "passed": value >= target}
            )
    if ours.get("setup_s") is not None:
        found.append(
            {
                "name": "asyncpaged setup s",
                "value": ours["setup_s"],
                "target": f"< {SETUP_TARGET_S}",
                "passed": ours["setup_s"] < SETUP_TARGET_S,
            }
        )
    return found


def format_table(summary: dict[str, Any]) -> str:
    head = (
        f"{'engine':<13} {'kv dtype':<9} {'tok/s':>8} {'wall s':>8} {'setup s':>8} "
        f"{'RSS MiB':>8} {'match':>5}"
    )
    lines = [head, "-" * len(head)]
    for engine, m in summary["medians"].items():
        kv = m.get("kv_cache_dtype", "auto")
        if m["num_runs"] == 0:
            lines.append(f"{engine:<13} {kv:<9} {'failed':>8}")
            continue
        match = {True: "yes", False: "NO", None: "n/a"}[m["match"]]
        lines.append(
            f"{engine:<13} {kv:<9} {m['tok_per_s']:>8.1f} {m['wall_s']:>8.2f} "
            f"{m['setup_s']:>8.2f} {m['peak_rss_mib']:>8.0f} {match:>5}"
        )
    lines.append("")
    for t in summary["targets"]:
        verdict = "PASS" if t["passed"] else "MISS"
        lines.append(f"{t['name']:<34} {t['value']:>7.2f}  (target {t['target']})  {verdict}")
    for r in summary["runs"]:
        if r["error"] is not None or r["match"] is False:
            lines.append(f"{r['engine']} (repeat {r['repeat']}): {r['error'] or r['check']}")
    for engine in dict.fromkeys(r["engine"] for r in summary["runs"] if r.get("unchecked")):
        lines.append(f"{engine}: tokens not checked (a quantized KV cache rounds K and V)")
    if summary["all_matched"] is None:
        lines.append(f"tokens not checked: {REFERENCE_ENGINE} did not run")
    else:
        verdict = "yes" if summary["all_matched"] else "NO"
        lines.append(f"all tokens match {REFERENCE_ENGINE}: {verdict}")
    lines.extend(format_profile(summary["runs"]))
    return "\n".join(lines)


def format_profile(runs: Sequence[dict[str, Any]]) -> list[str]:
    """asyncpaged's profile (median over repeats): where the timed wall time went."""
    profiled = [r for r in runs if r.get("profile") and r["wall_s"]]
    if not profiled:
        return []
    compute = statistics.median(r["profile"]["compute_s"] / r["wall_s"] for r in profiled)
    step = statistics.median(r["profile"]["step_s"] / r["wall_s"] for r in profiled)
    steps = statistics.median(r["profile"]["num_steps"] for r in profiled)
    return [
        f"asyncpaged profile ({steps:.0f} steps): model compute {100 * compute:.1f}% of the wall, "
        f"runner overhead {100 * (step - compute):.1f}%, engine outside the step "
        f"{100 * (1 - step):.1f}%; outside the model compute {100 * (1 - compute):.1f}% "
        f"(goal <= 10% at batch 32: --max-num-seqs 32)"
    ]


def plot(summary: dict[str, Any], path: Path) -> None:
    """A horizontal bar chart of median tok/s, with asyncpaged's target lines."""
    plt = pyplot()
    medians = {e: m["tok_per_s"] for e, m in summary["medians"].items() if m["tok_per_s"]}
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(medians) + 1.5))
    names = list(medians)[::-1]
    bars = ax.barh(
        names,
        [medians[n] for n in names],
        color=["tab:blue" if n == "asyncpaged" else "tab:gray" for n in names],
    )
    for (name, other, target), color in zip(TARGETS, ("tab:red", "tab:orange"), strict=True):
        if other in medians:
            ax.axvline(
                target * medians[other],
                color=color,
                linestyle="--",
                label=f"target: {name} >= {target}",
            )
    ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_xlabel("output tokens/s (median)")
    ax.set_title(summary["workload"]["description"], fontsize=8)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command --------------------------------------------------------------------------------


def engine_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for an EngineConfig field; VALUE is JSON (``false``, ``3``, ``"torch"``) or
    else a plain string."""
    import dataclasses
    import json

    from asyncpaged.config import EngineConfig

    key, sep, raw = text.partition("=")
    if not sep or key not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with an EngineConfig field")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def run(args: argparse.Namespace) -> int:
    engines: list[str] = args.engines
    prompt_lens = None if args.prompt_lens is None else (args.prompt_lens[0], args.prompt_lens[1])
    output_lens = None if args.output_lens is None else (args.output_lens[0], args.output_lens[1])
    workload = make_workload(quick=args.quick, num_requests=args.num_requests,
                             prompt_lens=prompt_lens, output_lens=output_lens)  # fmt: skip
    model_dir = Path(args.model_dir or DEFAULT_CACHE / workload.name).expanduser()
    build_checkpoint(workload, model_dir)
    base = WorkerSpec(
        engine=engines[0],
        model_dir=str(model_dir),
        quick=args.quick,
        num_requests=args.num_requests,
        threads=args.threads,
        prompt_lens=prompt_lens,
        output_lens=output_lens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_device_blocks=args.num_device_blocks,
        engine_options=dict(args.engine_option),
        cb_page_size=args.cb_page_size,
        cb_num_blocks=args.cb_num_blocks,
        cb_max_batch_tokens=args.cb_max_batch_tokens,
        malloc_tuning=not args.system_malloc,
        progress=not args.no_progress,
    )
    print(f"{workload.describe()}; {args.threads} torch thread(s), {args.repeats} repeat(s)")
    if "asyncpaged" in engines:
        print(prepare_cpu_kernel())
    runs = run_engines(base, engines, args.repeats)
    settings = {"engines": engines, "repeats": args.repeats, **asdict(base)}
    del settings["engine"], settings["progress"]
    summary = summarize(workload, runs, settings, machine_info())
    print(format_table(summary))
    save_report(Path(args.output), "throughput", summary, lambda png: plot(summary, png), indent=1)
    failed = any(r["error"] is not None for r in summary["runs"])
    return 1 if failed or summary["all_matched"] is False else 0


def prepare_cpu_kernel() -> str:
    """Build (or find cached) the native CPU attention kernel before any worker starts, so a
    first run's compile is reported here rather than counted as engine setup."""
    import time

    from asyncpaged.kernels import cpu_build

    start = time.perf_counter()
    library = cpu_build.load_library()
    seconds = time.perf_counter() - start
    if library is None:
        return "CPU attention kernel: unavailable here (asyncpaged falls back to torch)"
    return f"CPU attention kernel: ready in {seconds:.2f} s (target {cpu_build.select_target()})"


def engine_list(text: str) -> list[str]:
    """``--engines``: a comma list of known engines, in the order given."""
    engines = list(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise argparse.ArgumentTypeError(
            f"engines must be a comma list of {', '.join(ENGINES)}; got {text!r}."
        )
    return engines


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}.")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "throughput",
        help="output tokens/s: asyncpaged vs transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engines", type=engine_list, default=list(ENGINES), help="comma list (default: all)"
    )
    p.add_argument("--quick", action="store_true", help="the small smoke-test workload")
    p.add_argument("--num-requests", type=int, help="override the workload's request count")
    p.add_argument(
        "--prompt-lens",
        type=positive_int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="draw prompt lengths from MIN-MAX (e.g. long prompts: KV-bound)",
    )
    p.add_argument("--output-lens", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                   help="draw max_tokens from MIN-MAX")  # fmt: skip
    p.add_argument(
        "--repeats", type=positive_int, default=1, help="round-robin runs; medians reported"
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads in every worker")
    p.add_argument("--output", default="bench-results", help="directory for JSON and PNG")
    p.add_argument("--model-dir", help="checkpoint cache (default ~/.cache/asyncpaged/bench/NAME)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="asyncpaged")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="asyncpaged")
    p.add_argument("--num-device-blocks", type=int, help="asyncpaged (default: the workload)")
    p.add_argument(
        "--engine-option",
        type=engine_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="asyncpaged: an EngineConfig field (repeatable), e.g. screened_lm_head=false",
    )
    p.add_argument("--cb-page-size", type=int, default=16, help="hf-cb tokens per page")
    p.add_argument("--cb-num-blocks", type=int, help="hf-cb pages (default: the workload)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=1024, help="hf-cb tokens per step")
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="glibc's default malloc thresholds in every worker (default: raised, as the CLI does)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(func=run)
