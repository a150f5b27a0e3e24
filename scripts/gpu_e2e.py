"""End-to-end generation on CUDA through the public API (stage 3 of scripts/gpu_check.sh).

On the built-in model, in float32 with the Triton attention backend (``attention_backend="auto"``
picks it on CUDA):

1. Greedy tokens of concurrent requests against transformers' ``generate`` on the same GPU.
2. The same requests with a KV cache too small for all of them and ``preemption_mode="swap"``: the
   tokens must equal the unconstrained run's, and the engine must have swapped (pinned host memory,
   side stream).
3. Throughput of many concurrent greedy requests, float32 and bfloat16 (bfloat16 is not exact).
4. With ``--profile``: the float32 run again under cProfile (the event loop's thread and the
   forward's thread apart) and, on CUDA, torch's profiler for the GPU kernels, to see where a
   step's time goes.

``python scripts/gpu_e2e.py [--out results.json]``; exits non-zero when 1 or 2 fails.
``--device cpu --load 16`` rehearses it on a CPU (the CPU attention backend, a small load).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import pstats
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio
import structlog
import torch

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.default_model import path as default_model_path
from asyncpaged.worker.runner import ModelRunner


def _prompts(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 3072) for _ in range(rng.randint(low, high))] for _ in range(n)]


async def _engine_run(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], float, dict[str, Any]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs: dict[int, list[int]] = {}
    async with AsyncEngine(config) as engine:
        # Warm-up: Triton compiles each kernel variant on its first launch, so a few concurrent
        # requests of different lengths (prefills, then decodes) go first.
        async def warm(n: int) -> None:
            await engine.generate([1] * n, SamplingParams(max_tokens=8, ignore_eos=True))

        async with anyio.create_task_group() as tg:
            for n in (5, 20, 100, 300):
                tg.start_soon(warm, n)
        await engine.wait_idle()
        before = engine.statistics()
        start = time.perf_counter()

        async def one(i: int) -> None:
            outs[i] = list((await engine.generate(prompts[i], params)).outputs[0].token_ids)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        await engine.wait_idle()
        elapsed = time.perf_counter() - start
        stats = engine.statistics()
        runner = engine.runner  # None: the runner is in its own process
        backend = type(runner.model.attn_backend).__name__ if runner else "runner process"
    info = {
        "backend": backend,
        "executor": "thread" if runner else "process",
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "swap_outs": stats.num_swap_outs - before.num_swap_outs,
        "swap_ins": stats.num_swap_ins - before.num_swap_ins,
        "steps": stats.num_steps - before.num_steps,
    }
    return [outs[i] for i in range(len(prompts))], elapsed, info


def _hf_greedy(prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = str(default_model_path())
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(torch.device(device)).eval()
    result = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
            )
            result.append(out[0, len(prompt) :].tolist())
    return result


def _config(device: str, executor: str, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "model": str(default_model_path()),
        "device": device,
        "executor_backend": executor,
        "dtype": "float32",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
    }
    settings.update(overrides)
    return EngineConfig(**settings)


@contextlib.contextmanager
def _forward_profiled(profile: cProfile.Profile) -> Iterator[None]:
    """Profile every ``ModelRunner.execute`` (it runs in the executor's worker thread)."""
    execute = ModelRunner.execute

    def profiled(self: ModelRunner, plan: Any) -> Any:
        return profile.runcall(execute, self, plan)

    ModelRunner.execute = profiled  # type: ignore[method-assign]
    try:
        yield
    finally:
        ModelRunner.execute = execute  # type: ignore[method-assign]


def _top(profile: cProfile.Profile, title: str, rows: int = 18) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(rows)
    body = out.getvalue().split("\n")
    start = next(i for i, line in enumerate(body) if line.lstrip().startswith("ncalls"))
    return "\n".join([f"--- {title} (by own time) ---", *body[start:]]).rstrip()


def _profile_run(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> None:
    """The run again under cProfile and, on CUDA, torch's profiler for the GPU's kernels (its
    CPU side would see only this thread, not the forward's); prints the tables. Before Python
    3.12 one profile per thread (the loop's, the forward's); from 3.12 cProfile is
    ``sys.monitoring``'s one profiler tool, which sees every thread: one profile of both."""
    per_thread = sys.version_info < (3, 12)
    loop_profile, forward_profile = cProfile.Profile(), cProfile.Profile()
    on_cuda = config.device == "cuda"
    gpu = torch.profiler.ProfilerActivity.CUDA
    with (
        torch.profiler.profile(activities=[gpu]) if on_cuda else contextlib.nullcontext() as prof,
        _forward_profiled(forward_profile) if per_thread else contextlib.nullcontext(),
    ):
        loop_profile.enable()
        _, elapsed, info = anyio.run(_engine_run, config, prompts, max_tokens)
        loop_profile.disable()
    print(f"4. profiled run: {elapsed:.2f} s, {info['steps']} steps (profilers add overhead)")
    if per_thread:
        print(_top(loop_profile, "event loop thread: scheduling, allocation, streaming"))
        print(_top(forward_profile, "forward thread: ModelRunner.execute"))
    else:
        print(_top(loop_profile, "both threads (the loop's and the forward's)", rows=30))
    if prof is not None:
        print("--- GPU kernels (torch profiler, by self CUDA time) ---")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--load", type=int, default=256, help="requests of the throughput runs")
    parser.add_argument("--profile", action="store_true", help="4. profile the float32 run")
    parser.add_argument("--executor-backend", default="auto", choices=["auto", "thread", "process"])
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    # transformers and asyncpaged must both do true fp32 products for token equality.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    results: dict[str, Any] = {"device": name}
    failed = False

    prompts = _prompts(12, seed=0, low=5, high=120)
    max_tokens = 48
    got, _, info = anyio.run(
        _engine_run,
        _config(device, args.executor_backend, num_device_blocks=512),
        prompts,
        max_tokens,
    )
    want = _hf_greedy(prompts, max_tokens, device)
    equal = sum(g == w for g, w in zip(got, want, strict=True))
    first_diff = [
        next((j for j, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]
    results["vs_transformers"] = {"requests": len(prompts), "equal": equal, **info}
    print(
        f"1. greedy vs transformers on {device} (fp32, {info['backend']}, {info['executor']}): "
        f"{equal}/{len(prompts)} requests token-identical ({max_tokens} tokens each)"
    )
    if equal != len(prompts):
        failed = True
        print(f"   first differing position per request: {first_diff}")

    # 12 requests x up to 10 blocks each against 24 blocks: preemption is certain.
    swapped, _, sinfo = anyio.run(
        _engine_run,
        _config(device, args.executor_backend, num_device_blocks=24, preemption_mode="swap"),
        prompts,
        max_tokens,
    )
    swap_equal = sum(g == s for g, s in zip(got, swapped, strict=True))
    results["swap"] = {"equal": swap_equal, **sinfo}
    print(
        f"2. 24-block cache, preemption by swap: {swap_equal}/{len(prompts)} equal to the "
        f"unconstrained run; preemptions {sinfo['preemptions']}, swap-outs "
        f"{sinfo['swap_outs']}, swap-ins {sinfo['swap_ins']}"
    )
    if swap_equal != len(prompts) or sinfo["swap_outs"] == 0:
        failed = True

    load = _prompts(args.load, seed=1, low=16, high=200)
    out_tokens = 128
    results["throughput"] = {}
    for dtype in ("float32", "bfloat16"):
        tokens, elapsed, tinfo = anyio.run(
            _engine_run,
            _config(device, args.executor_backend, dtype=dtype, num_device_blocks=8192),
            load,
            out_tokens,
        )
        n = sum(len(t) for t in tokens)
        results["throughput"][dtype] = {"tokens": n, "seconds": elapsed, **tinfo}
        print(
            f"3. {len(load)} requests x {out_tokens} tokens, {dtype}: {n / elapsed:.0f} tok/s "
            f"({elapsed:.2f} s, {tinfo['steps']} steps, runner {tinfo['executor']})"
        )
    if args.profile:
        _profile_run(_config(device, "thread", num_device_blocks=8192), load, out_tokens)
    results["failed"] = failed
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
