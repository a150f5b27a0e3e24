"""The simulator's Python API (:func:`simulate`) and what one run reports (:class:`SimResult`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asyncpaged._log import get_logger
from asyncpaged.sched.scheduler import PreemptionMode
from asyncpaged.sim.cost_model import CostModel
from asyncpaged.sim.presets import GPUS, MODELS, GpuSpec, ModelShape, num_kv_blocks
from asyncpaged.sim.reservation import Placement
from asyncpaged.sim.simulator import SimConfig, SimEngine, StepRecord
from asyncpaged.sim.workload import SimRequest, WorkloadSpec, generate

log = get_logger(__name__)

NUM_TIMELINE_POINTS = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """One configuration's outcome.

    Utilization is tokens stored / slots reserved (held blocks, plus unused reservations for the
    baselines), averaged over the steps while requests wait (the contended steps; all steps if
    none waited); ``kv_util_peak`` is the same at the step storing the most tokens.
    """

    system: str
    model: str
    gpu: str
    rate: float
    num_requests: int
    num_device_blocks: int
    block_size: int
    makespan_s: float
    throughput_rps: float
    throughput_tokens_per_s: float
    normalized_latency_s: float  # mean over requests of latency / output tokens
    kv_util_mean: float
    kv_util_peak: float
    kv_occupancy_mean: float  # tokens stored / all device slots, contended steps
    batch_size_mean: float
    batch_size_max: int
    num_steps: int
    num_preemptions: int
    num_swap_outs: int
    swap_out_bytes: int
    swap_in_bytes: int
    wall_s: float
    timeline: tuple[tuple[float, int, float], ...]  # (time, batch size, utilization), sampled


def simulate(
    workload: WorkloadSpec | Sequence[SimRequest],
    *,
    model: str | ModelShape = "opt-13b",
    gpu: str | GpuSpec = "a100-40gb",
    system: str = "paged",
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    num_gpus: int = 1,
    num_device_blocks: int | None = None,
    swap_space_bytes: int = 0,
    preemption_mode: PreemptionMode = "recompute",
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    paged_overhead: float = 0.2,
    enable_prefix_caching: bool | None = None,
    placement: Placement = "buddy",
    seed: int = 0,
) -> SimResult:
    """Run a workload through the engine's scheduler and block pool on a simulated GPU.

    ``enable_prefix_caching`` defaults to on exactly when the workload has a shared prefix
    (then prompts are that prefix plus per-request tokens); the baselines never cache.
    ``placement`` is how the baselines place each request's contiguous reservation.
    """
    shape = MODELS[model] if isinstance(model, str) else model
    spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    requests = generate(workload) if isinstance(workload, WorkloadSpec) else list(workload)
    shared = workload.shared_prefix_len if isinstance(workload, WorkloadSpec) else 0
    if num_device_blocks is None:
        num_device_blocks = num_kv_blocks(
            shape,
            spec,
            block_size=block_size,
            num_gpus=num_gpus,
            gpu_memory_utilization=gpu_memory_utilization,
        )
    block_bytes = block_size * shape.kv_bytes_per_token
    config = SimConfig(
        system=system,
        num_device_blocks=num_device_blocks,
        num_host_blocks=swap_space_bytes // block_bytes,
        block_size=block_size,
        preemption_mode=preemption_mode,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or shape.max_model_len,
        enable_prefix_caching=(
            shared > 0 if enable_prefix_caching is None else enable_prefix_caching
        )
        and system == "paged",
        max_model_len=shape.max_model_len,
        placement=placement,
    )
    cost = CostModel(model=shape, gpu=spec, num_gpus=num_gpus, paged_overhead=paged_overhead)
    engine = SimEngine(config, cost, seed=seed, record_decisions=False)
    prompts = None
    if shared:
        prefix = [1 + i % 30000 for i in range(shared)]
        prompts = {
            r.request_id: prefix + [30001 + i] * (r.prompt_len - shared)
            for i, r in enumerate(requests)
        }
    start = time.perf_counter()
    engine.run(requests, prompts)
    wall = time.perf_counter() - start
    rate = workload.rate if isinstance(workload, WorkloadSpec) else math.nan
    result = summarize(engine, requests, shape.name, spec.name, rate, wall)
    log.info(
        "simulation_finished",
        system=system,
        rate=rate,
        num_requests=len(requests),
        num_steps=result.num_steps,
        wall_s=round(wall, 3),
    )
    return result


def summarize(
    engine: SimEngine,
    requests: Sequence[SimRequest],
    model: str,
    gpu: str,
    rate: float,
    wall_s: float,
) -> SimResult:
    """Throughput, latency, utilization and swap traffic of a finished run."""
    records = engine.records
    finish = engine.counters.finish_s
    first = min(r.arrival_s for r in requests)
    makespan = max(finish.values()) - first if finish else 0.0
    latencies = [(finish[r.request_id] - r.arrival_s) / r.output_len for r in requests]
    num_tokens = sum(r.output_len * max(r.n, r.beam_width) for r in requests)
    busy = [s for s in records if s.num_batched_tokens]
    contended = [s for s in busy if s.num_waiting] or busy
    slots = engine.config.num_device_blocks * engine.config.block_size
    utils = [_util(s) for s in contended]
    peak = max(contended, key=lambda s: s.num_stored_tokens) if contended else None
    block_bytes = engine.config.block_size * (
        engine.cost.model.kv_bytes_per_token if engine.cost else 0
    )
    sched = engine.scheduler.statistics()
    return SimResult(
        system=engine.config.system,
        model=model,
        gpu=gpu,
        rate=rate,
        num_requests=len(requests),
        num_device_blocks=engine.config.num_device_blocks,
        block_size=engine.config.block_size,
        makespan_s=makespan,
        throughput_rps=len(requests) / makespan if makespan else math.inf,
        throughput_tokens_per_s=num_tokens / makespan if makespan else math.inf,
        normalized_latency_s=sum(latencies) / len(latencies),
        kv_util_mean=sum(utils) / len(utils) if utils else 0.0,
        kv_util_peak=_util(peak) if peak else 0.0,
        kv_occupancy_mean=sum(s.num_stored_tokens for s in contended) / (len(contended) * slots)
        if contended
        else 0.0,
        batch_size_mean=sum(_batch(s) for s in busy) / len(busy) if busy else 0.0,
        batch_size_max=max((_batch(s) for s in busy), default=0),
        num_steps=len(records),
        num_preemptions=sched.num_preemptions,
        num_swap_outs=sched.num_swap_outs,
        swap_out_bytes=engine.counters.swap_out_blocks * block_bytes,
        swap_in_bytes=engine.counters.swap_in_blocks * block_bytes,
        wall_s=wall_s,
        timeline=_timeline(busy),
    )


def _util(s: StepRecord) -> float:
    return s.num_stored_tokens / s.num_reserved_slots if s.num_reserved_slots else 1.0


def _batch(s: StepRecord) -> int:
    return s.num_seqs


def _timeline(steps: Sequence[StepRecord]) -> tuple[tuple[float, int, float], ...]:
    stride = max(1, len(steps) // NUM_TIMELINE_POINTS)
    return tuple((s.start_s, _batch(s), _util(s)) for s in steps[::stride])
