"""Tensor parallelism on torch.distributed, with one central scheduler and KV manager.

The engine process is rank 0: it keeps the scheduler, the block pool and the swap bookkeeping,
and its executor broadcasts every step (and every swap) to ranks 1 .. N-1, which hold the other
shards of the weights and of the KV cache. See docs/distributed.md.

- :class:`TensorParallelRunner`: rank 0 (built by ``AsyncEngine`` when
  ``EngineConfig.tensor_parallel_size`` > 1).
- :func:`serve_worker`: the entry of ranks 1 .. N-1 under ``torchrun``.
"""

from asyncpaged.distributed.commands import WorkerReady
from asyncpaged.distributed.driver import (
    TensorParallelRunner,
    check_tensor_parallel,
    worker_spec,
)
from asyncpaged.distributed.worker import serve_worker
from asyncpaged.worker.runner import WorkerSpec

__all__ = [
    "TensorParallelRunner",
    "WorkerReady",
    "WorkerSpec",
    "check_tensor_parallel",
    "serve_worker",
    "worker_spec",
]
