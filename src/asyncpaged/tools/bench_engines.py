"""The per-engine runners of ``asyncpaged bench throughput``, each in its own worker process.

    python -m asyncpaged.tools.bench_engines --spec '{"engine": "hf-single", ...}' --result out.json

A worker rebuilds the workload from its seed, sets the torch thread count, then:

1. **setup** (timed, ``setup_s``): from the start of model/engine construction until it is ready
   to serve (asyncpaged: ``AsyncEngine(...)`` plus ``__aenter__``; transformers:
   ``from_pretrained`` plus, for ``hf-cb``, the paged cache and its manager thread). The checkpoint
   itself is built beforehand by the parent and never timed;
2. **warm-up** (not timed): one tiny request;
3. **timed run** (``wall_s``): every request of the workload, greedy, EOS ignored;

and writes ``tokens`` (one list per request, in workload order), ``wall_s``, ``setup_s`` and
``peak_rss_mib`` (``ru_maxrss`` of the worker and of its largest reaped child, the runner's
process) as JSON to ``--result``. Progress over requests goes to stderr.

Engines:

* ``asyncpaged``: all requests submitted at once to one :class:`~asyncpaged.AsyncEngine` (an anyio
  task group), its KV pool sized to hold the whole workload unless ``num_device_blocks`` is given;
* ``hf-single``: transformers ``generate``, one request at a time (the token reference);
* ``hf-static-B``: ``generate`` on left-padded static batches of B requests in workload order,
  each batch running to its longest ``max_tokens``; each request keeps only its own ``max_tokens``
  tokens (what a user of static batching gets);
* ``hf-cb``: transformers' continuous batching (``init_continuous_batching``) with its paged
  cache. Requests carry their own ``max_new_tokens`` and ``eos_token_id=-1`` (EOS disabled).
  Tuned on the reference workload (transformers 5.24, 1 thread, noisy shared 2-vCPU host):
  ``sdpa`` attention (flash is CUDA-only; ``paged|eager`` ran 50 tok/s), pages of 16 tokens,
  pages enough for the whole workload (the default sizing takes 60% of free RAM: 12 s to
  allocate), ``max_batch_tokens`` 1024 (87 tok/s at 256, 96 at 512, 90-118 at 1024, 120 at
  2048; pages of 32/64/256 tokens ran 74/107/95), prefix sharing off (no shared prefixes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from asyncpaged._log import get_logger
from asyncpaged.tools.bench_workload import Workload, make_workload
from asyncpaged.tools.malloc_tuning import MALLOC_ENV

STATIC_BATCH_SIZES = (8, 16, 64)
ENGINES = ("asyncpaged", "hf-single", *(f"hf-static-{b}" for b in STATIC_BATCH_SIZES), "hf-cb")
REFERENCE_ENGINE = "hf-single"
WARMUP_PROMPT = (5, 6, 7, 8)
PAD_ID = 0
CB_ATTENTION = "sdpa"
WORKER_MODULE = "asyncpaged.tools.bench_engines"

log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """Everything a worker needs, passed as JSON on its command line."""

    engine: str
    model_dir: str
    quick: bool
    num_requests: int | None
    threads: int
    # the workload's length ranges (``make_workload``; None: the workload's own)
    prompt_lens: tuple[int, int] | None = None
    output_lens: tuple[int, int] | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_device_blocks: int | None = None  # asyncpaged; None: sized to the workload
    block_size: int = 16  # asyncpaged
    # asyncpaged: EngineConfig fields to override (`--engine-option`), e.g. a CPU lever flipped
    engine_options: dict[str, Any] = field(default_factory=dict)
    cb_page_size: int = 16
    cb_num_blocks: int | None = None  # None: sized to the workload (whole-model pages)
    cb_max_batch_tokens: int = 1024
    malloc_tuning: bool = True  # every engine's process, baselines included (malloc_tuning.py)
    progress: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


def blocks_for_workload(workload: Workload, block_size: int) -> int:
    """KV blocks that hold every request of the workload at once, plus one spare per request."""
    return sum(
        math.ceil((len(p) + n) / block_size) + 1
        for p, n in zip(workload.prompts, workload.max_tokens, strict=True)
    )


def peak_rss_mib() -> float:
    """This process's peak resident set size plus its largest reaped child's: asyncpaged's
    runner process (``executor_backend="process"``, reaped when the engine closes) holds the
    KV cache and the forward's buffers. An upper bound of the two together, whose peaks need
    not coincide (Linux reports ``ru_maxrss`` in KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (own + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


def _progress(spec: WorkerSpec, total: int) -> Any:
    """A bar over requests on stderr, erased when done (the parent's bar stays)."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # a transformers dependency

    desc = f"  {spec.engine}"
    return tqdm(total=total, desc=desc, unit="req", leave=False, disable=not spec.progress)


# ---- asyncpaged -------------------------------------------------------------------------------


def engine_settings(spec: WorkerSpec, workload: Workload) -> dict[str, Any]:
    """The ``EngineConfig`` fields asyncpaged runs the workload with: the bench's own (float32,
    the block budget, the batching limits), each overridden by ``spec.engine_options``."""
    num_blocks = spec.num_device_blocks or blocks_for_workload(workload, spec.block_size)
    settings: dict[str, Any] = {
        "model": spec.model_dir,
        "dtype": "float32",
        "block_size": spec.block_size,
        "num_device_blocks": num_blocks,
        "max_num_seqs": spec.max_num_seqs,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
    }
    return {**settings, **spec.engine_options}


async def _run_asyncpaged(spec: WorkerSpec, workload: Workload) -> dict[str, Any]:
    import anyio

    from asyncpaged.config import EngineConfig
    from asyncpaged.engine.async_engine import AsyncEngine
    from asyncpaged.sampling_params import SamplingParams

    config = EngineConfig(**engine_settings(spec, workload))
    tokens: list[list[int]] = [[] for _ in workload.prompts]
    start = time.perf_counter()
    async with AsyncEngine(config) as engine:
        setup_s = time.perf_counter() - start
        warmup = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        await engine.generate(WARMUP_PROMPT, warmup)
        with _progress(spec, workload.num_requests) as bar:

            async def one(i: int) -> None:
                params = SamplingParams(
                    temperature=0.0, max_tokens=workload.max_tokens[i], ignore_eos=True
                )
                out = await engine.generate(workload.prompts[i], params)
                tokens[i] = list(out.outputs[0].token_ids)
                bar.update(1)

            before = engine.statistics()
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(workload.num_requests):
                    tg.start_soon(one, i)
            wall_s = time.perf_counter() - start
            after = engine.statistics()
    settings = {
        "num_device_blocks": config.num_device_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }  # (as run)
    # The profile: how much of the timed wall went into the model forward, LM head and
    # sampling (compute), the rest of the executor's step (inputs, results, thread hop), and
    # everything else (scheduling, allocation, output processing, detokenization).
    profile = {
        "compute_s": after.compute_time_s - before.compute_time_s,
        "step_s": after.step_time_s - before.step_time_s,
        "num_steps": after.num_steps - before.num_steps,
    }
    return {"tokens": tokens, "wall_s": wall_s, "setup_s": setup_s, "settings": settings,
            "profile": profile}  # fmt: skip


# ---- transformers generate --------------------------------------------------------------------


def _load_hf(spec: WorkerSpec, **kwargs: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32, **kwargs)
    return model.eval()


def _generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy ``generate`` on left-padded ``prompts``; EOS never stops (``eos_token_id=None``)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )
    generated: list[list[int]] = out[:, width:].tolist()
    return generated


def _run_hf_batched(spec: WorkerSpec, workload: Workload, batch_size: int) -> dict[str, Any]:
    start = time.perf_counter()
    model = _load_hf(spec)
    setup_s = time.perf_counter() - start
    _generate(model, [WARMUP_PROMPT], 2)
    tokens: list[list[int]] = []
    with _progress(spec, workload.num_requests) as bar:
        start = time.perf_counter()
        for first in range(0, workload.num_requests, batch_size):
            prompts = workload.prompts[first : first + batch_size]
            wanted = workload.max_tokens[first : first + batch_size]
            batch = _generate(model, prompts, max(wanted))
            tokens.extend(row[:n] for row, n in zip(batch, wanted, strict=True))
            bar.update(len(prompts))
        wall_s = time.perf_counter() - start
    settings = {"batch_size": batch_size, "padding": "left"}
    return {"tokens": tokens, "wall_s": wall_s, "setup_s": setup_s, "settings": settings}


# ---- transformers continuous batching ---------------------------------------------------------


def _cb_generate(
    manager: Any, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], bar: Any = None
) -> list[list[int]]:
    ids = [
        manager.add_request(list(p), max_new_tokens=n, eos_token_id=-1)
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early.")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
            if bar is not None:
                bar.update(1)
    return [done[i] for i in ids]


def _run_hf_cb(spec: WorkerSpec, workload: Workload) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    num_blocks = spec.cb_num_blocks or blocks_for_workload(workload, spec.cb_page_size)
    cb_config = ContinuousBatchingConfig(
        page_size=spec.cb_page_size,
        num_blocks=num_blocks,
        max_batch_tokens=spec.cb_max_batch_tokens,
        allow_block_sharing=False,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.max_tokens),
        num_requests=workload.num_requests,
    )
    gen_config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False,
        max_new_tokens=max(workload.max_tokens),
        eos_token_id=-1,
        pad_token_id=PAD_ID,
    )
    start = time.perf_counter()
    model = _load_hf(spec, attn_implementation=CB_ATTENTION)
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    manager.warmup()  # allocates the paged cache (no graphs to capture on CPU)
    manager.start()
    setup_s = time.perf_counter() - start
    try:
        _cb_generate(manager, [WARMUP_PROMPT], [2])
        with _progress(spec, workload.num_requests) as bar:
            start = time.perf_counter()
            tokens = _cb_generate(manager, workload.prompts, workload.max_tokens, bar)
            wall_s = time.perf_counter() - start
        resolved = manager.continuous_batching_config
        settings = {
            "attn_implementation": model.config._attn_implementation,
            "page_size": resolved.page_size,
            "num_blocks": resolved.num_blocks,
            "max_batch_tokens": resolved.max_batch_tokens,
            "max_requests_per_batch": resolved.max_requests_per_batch,
        }
    finally:
        manager.stop(block=True, timeout=30)
    return {"tokens": tokens, "wall_s": wall_s, "setup_s": setup_s, "settings": settings}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRun:
    """One worker's result: ``error`` is set (and the numbers are zero) if the worker failed."""

    engine: str
    repeat: int
    tokens: tuple[tuple[int, ...], ...] = ()
    wall_s: float = 0.0
    setup_s: float = 0.0
    peak_rss_mib: float = 0.0
    threads: int = 0
    settings: dict[str, Any] | None = None
    profile: dict[str, float] | None = None  # asyncpaged only: compute_s, step_s, num_steps
    error: str | None = None

    @classmethod
    def from_worker(cls, repeat: int, data: dict[str, Any]) -> EngineRun:
        numbers = {k: data[k] for k in ("wall_s", "setup_s", "peak_rss_mib", "threads")}
        tokens = tuple(tuple(t) for t in data["tokens"])
        return cls(
            engine=data["engine"],
            repeat=repeat,
            tokens=tokens,
            **numbers,
            settings=data.get("settings"),
            profile=data.get("profile"),
        )


# ---- the parent side: one fresh process per engine run --------------------------------------


def worker_env(threads: int, malloc_tuning: bool) -> dict[str, str]:
    """The same environment for every worker: this one, with the thread count pinned and glibc
    malloc's thresholds raised (or left at glibc's defaults)."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"
    )
    for name in MALLOC_ENV:
        env.pop(name, None)
    if malloc_tuning:
        env.update(MALLOC_ENV)
    return env


def run_one(spec: WorkerSpec, repeat: int) -> EngineRun:
    """Run one engine in a fresh ``python -m asyncpaged.tools.bench_engines`` process.

    The worker's stderr (its progress bar) passes through; its stdout is forwarded to stderr.
    """
    with tempfile.TemporaryDirectory(prefix="asyncpaged-bench-") as tmp:
        result = Path(tmp) / "result.json"
        argv = ["--spec", spec.to_json(), "--result", str(result)]
        proc = subprocess.run(
            [sys.executable, "-m", WORKER_MODULE, *argv],
            stdout=subprocess.PIPE,
            env=worker_env(spec.threads, spec.malloc_tuning),
            text=True,
            check=False,
        )
        if proc.stdout:
            sys.stderr.write(proc.stdout)
        if proc.returncode != 0 or not result.is_file():
            log.error("bench_worker_failed", engine=spec.engine, returncode=proc.returncode)
            error = f"worker exited with status {proc.returncode}"
            return EngineRun(engine=spec.engine, repeat=repeat, error=error)
        return EngineRun.from_worker(repeat, json.loads(result.read_text()))


def run_engines(base: WorkerSpec, engines: Sequence[str], repeats: int) -> list[EngineRun]:
    """Every engine ``repeats`` times, round-robin: repeat r starts at engine r (mod n)."""
    from tqdm import tqdm

    runs: list[EngineRun] = []
    total = len(engines) * repeats
    with tqdm(total=total, desc="engine runs", unit="run", disable=not base.progress) as bar:
        for repeat in range(repeats):
            shift = repeat % len(engines)
            for engine in [*engines[shift:], *engines[:shift]]:
                bar.set_postfix_str(engine)
                runs.append(run_one(replace(base, engine=engine), repeat))
                bar.update(1)
    return runs


# ---- the worker process -------------------------------------------------------------------------


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Run one engine on the workload in this process; the result as a JSON-ready dict."""
    import torch

    torch.set_num_threads(spec.threads)
    prompts, outputs = spec.prompt_lens, spec.output_lens  # lists, as JSON gives them back
    workload = make_workload(
        quick=spec.quick, num_requests=spec.num_requests,
        prompt_lens=None if prompts is None else (prompts[0], prompts[1]),
        output_lens=None if outputs is None else (outputs[0], outputs[1]),
    )  # fmt: skip
    if spec.engine == "asyncpaged":
        import anyio

        result = anyio.run(_run_asyncpaged, spec, workload)
    elif spec.engine == "hf-single":
        result = _run_hf_batched(spec, workload, 1)
    elif spec.engine.startswith("hf-static-"):
        result = _run_hf_batched(spec, workload, int(spec.engine.removeprefix("hf-static-")))
    elif spec.engine == "hf-cb":
        result = _run_hf_cb(spec, workload)
    else:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {spec.engine!r}.")
    result.update(engine=spec.engine, threads=torch.get_num_threads(), peak_rss_mib=peak_rss_mib())
    return result


def _quiet_worker_logs() -> None:
    """The worker is an application: engine events at warning and above go to stderr (as with
    the ``asyncpaged`` command's default), transformers' loading bars and notices are off, and
    its continuous-batching logger's psutil notices (irrelevant: the cache is sized here) too."""
    import logging

    from transformers.utils import logging as hf_logging

    from asyncpaged.tools import cli_log

    cli_log.configure("warning")
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    logging.getLogger("ContinuousBatchingLogger").addFilter(
        lambda record: "psutil" not in record.getMessage()
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one engine run of `asyncpaged bench throughput`")
    parser.add_argument("--spec", required=True, help="a WorkerSpec as JSON")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    spec = WorkerSpec.from_json(args.spec)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _quiet_worker_logs()
    result = run_worker(spec)
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
