"""Tensor-parallel ranks 1 .. N-1: receive a command, run it, repeat.

A worker holds one shard of the weights and of the KV cache (``ModelRunner`` with a
``TensorShard``) and makes no decision of its own: rank 0's scheduler and block pool decide
everything, and each command carries what the worker needs (``commands.py``). It exits when told
(``Shutdown``), when rank 0's end closes the control group's socket (a collective error), or,
for spawned workers, when the engine terminates it.

Two ways in: ``_spawned_main`` (the engine spawned this process, passing its TCPStore's address)
and :func:`serve_worker` (a ``torchrun`` launch: every rank but 0 calls it).
"""

from __future__ import annotations

import os
import signal

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public API

from asyncpaged._log import get_logger
from asyncpaged.distributed.commands import (
    CaptureGraphs,
    GraphsCaptured,
    RunStep,
    Shutdown,
    SwapCommand,
    WorkerReady,
)
from asyncpaged.distributed.group import INIT_TIMEOUT_S, JOINED_KEY, ProcessGroups, torchrun_env
from asyncpaged.kv.block_table import SwapDirection
from asyncpaged.model.attention import AttentionBackend
from asyncpaged.model.base import TensorShard
from asyncpaged.worker.cuda_graphs import eager_capture
from asyncpaged.worker.runner import ModelRunner, WorkerSpec
from asyncpaged.worker.runner_logs import LogBatch, capture_library_logs, release_library_logs

log = get_logger(__name__)


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """The device a rank computes on: the CPU, or the CUDA device of its local rank."""
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device(device_type)


def build_runner(
    spec: WorkerSpec,
    groups: ProcessGroups,
    device: torch.device,
    rank: int,
    backend: AttentionBackend | None = None,
) -> ModelRunner:
    """This rank's shard: its weights, its share of the KV heads, the same number of blocks.
    ``backend`` None: select one as the engine does (the C++ kernel is cached by then: rank 0
    builds it before it starts the workers)."""
    torch.set_num_threads(spec.num_threads)
    shard = TensorShard(rank=rank, world_size=groups.world_size, all_reduce=groups.all_reduce)
    return ModelRunner.from_spec(spec, device, attn_backend=backend, shard=shard)


def ready_reply(
    rank: int,
    runner: ModelRunner | None,
    error: BaseException | None,
    logs: LogBatch | None = None,
) -> WorkerReady:
    if runner is None:
        return WorkerReady(rank=rank, pid=os.getpid(), error=error, logs=logs)
    return WorkerReady(
        rank=rank,
        pid=os.getpid(),
        kv_cache_bytes=runner.kv_cache.num_bytes,
        host_kv_cache_bytes=runner.host_kv_cache.num_bytes,
        num_kv_heads=runner.model.num_kv_heads,
        logs=logs,
    )


def _serve(groups: ProcessGroups, local_rank: int) -> None:
    """Load this rank's shard, report, then run commands until ``Shutdown``. The library's
    log events of the load and of a graph capture go to rank 0 with the replies, at the level
    the engine's process has (so the host's logging configuration decides what shows); the
    steps' ones stay in this process, as its own configuration has them."""
    rank = groups.rank
    got = groups.broadcast_spec(None)
    assert isinstance(got, tuple), f"expected (WorkerSpec, log level), got {type(got).__name__}"
    spec, level = got
    assert isinstance(spec, WorkerSpec), f"expected a WorkerSpec, got {type(spec).__name__}"
    logs = capture_library_logs(level, process_name=f"asyncpaged-tp-rank-{rank}")
    bound = log.bind(rank=rank, pid=os.getpid())
    try:
        try:
            runner = build_runner(spec, groups, rank_device(spec.device_type, local_rank), rank)
        except Exception as exc:  # reported to rank 0, which raises it from the engine's start
            groups.gather(ready_reply(rank, None, exc, logs.take()))
            raise
        bound.debug("tp_worker_ready", kv_cache_bytes=runner.kv_cache.num_bytes)
        groups.gather(ready_reply(rank, runner, None, logs.take()))
    finally:
        release_library_logs(logs)
    while True:
        command = groups.receive()
        match command:
            case RunStep():
                runner.execute_forward(command.plan())
            case SwapCommand(direction=SwapDirection.OUT):
                runner.swap_out(command.pairs)
            case SwapCommand():
                runner.swap_in(command.pairs)
            case CaptureGraphs():
                _capture_graphs(runner, command, groups, level)
            case Shutdown():
                bound.debug("tp_worker_stopped")
                return


def _capture_graphs(
    runner: ModelRunner, command: CaptureGraphs, groups: ProcessGroups, level: int
) -> None:
    """Capture with rank 0 and the other ranks, then report the sizes and the capture's log
    events to rank 0 (an error propagates: this process exits, which rank 0's all-reduce
    notices)."""
    logs = capture_library_logs(level, process_name=f"asyncpaged-tp-rank-{groups.rank}")
    try:
        capture = eager_capture if command.eager else None
        sizes = runner.capture_cuda_graphs(command.sizes, command.max_model_len, capture)
        groups.gather(GraphsCaptured(rank=groups.rank, sizes=sizes, logs=logs.take()))
    finally:
        release_library_logs(logs)


def serve_worker(device_type: str | None = None) -> None:
    """Run this process as a tensor-parallel worker rank of a ``torchrun`` launch.

    Every rank but 0 calls it; rank 0 builds the ``AsyncEngine`` with
    ``tensor_parallel_size`` = WORLD_SIZE, which sends each rank what to load. ``device_type``
    ("cpu" or "cuda"; default: "cuda" when available) must match the engine's ``device``: it picks
    the all-reduce backend (gloo or NCCL) before the engine's settings arrive. Returns when the
    engine shuts down; raises when rank 0 goes away without a shutdown (its socket closes).
    """
    env = torchrun_env()
    if env is None:
        raise RuntimeError(
            "serve_worker() needs torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    if env.rank == 0:
        raise RuntimeError("rank 0 runs the AsyncEngine; serve_worker() is for ranks 1 .. N-1.")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    groups = ProcessGroups(rank=env.rank, world_size=env.world_size, device_type=device_type)
    try:
        _serve(groups, env.local_rank)
    finally:
        groups.destroy()


def _spawned_main(rank: int, world_size: int, host: str, port: int, device_type: str) -> None:
    """Entry of a worker process spawned by the engine (``multiprocessing`` "spawn")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine owns this process's lifetime
    from datetime import timedelta

    store = TCPStore(
        host, port, world_size, is_master=False, timeout=timedelta(seconds=INIT_TIMEOUT_S)
    )
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    store.set(JOINED_KEY.format(rank), "1")
    groups = ProcessGroups(rank=rank, world_size=world_size, device_type=device_type, store=store)
    try:
        _serve(groups, rank)
    finally:
        groups.destroy()
