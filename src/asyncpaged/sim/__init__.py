"""A simulator: the real block pool and scheduler on a virtual clock with a GPU cost model."""

from asyncpaged.sim.cost_model import CostModel
from asyncpaged.sim.presets import GPUS, MODELS, GpuSpec, ModelShape, kv_cache_bytes, num_kv_blocks
from asyncpaged.sim.results import SimResult, simulate
from asyncpaged.sim.simulator import SYSTEMS, SimConfig, SimEngine, StepRecord
from asyncpaged.sim.workload import SimRequest, WorkloadSpec, generate

__all__ = [
    "GPUS",
    "MODELS",
    "SYSTEMS",
    "CostModel",
    "GpuSpec",
    "ModelShape",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "SimResult",
    "StepRecord",
    "WorkloadSpec",
    "generate",
    "kv_cache_bytes",
    "num_kv_blocks",
    "simulate",
]
