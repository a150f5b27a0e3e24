"""Rank 0 of a tensor-parallel engine: its own shard, plus the commands that drive the others.

:class:`TensorParallelRunner` stands where a ``ModelRunner`` stands for the executor and swap
actors (``StepRunner``): ``execute`` broadcasts the step to the other ranks, then runs rank 0's
forward and samples; ``swap_out`` / ``swap_in`` broadcast the swap, then copy rank 0's share.
The scheduler, block pool and swap bookkeeping stay single, in the engine process; the workers
never decide anything.

::

   engine process (rank 0)                                   worker process (rank r)
   ┌────────────────────────────────────────────┐            ┌──────────────────────────────┐
   │ executor thread: lock, broadcast RunStep ──┼──control──►│ receive ─► execute_forward   │
   │                  unlock, execute (samples) │            │   all-reduce x2 per layer ◄┐ │
   │                  all-reduce x2 per layer ◄─┼───data────►│ ───────────────────────────┘ │
   │ swap thread:     lock, broadcast SwapCmd ──┼──control──►│ receive ─► swap_out/swap_in  │
   │                  unlock, copy own share    │            │                              │
   │ watchdog task:   worker exit ─► engine dead│            │                              │
   └────────────────────────────────────────────┘            └──────────────────────────────┘

Order: every rank runs the commands in the order rank 0 broadcast them (the lock). A swap's
command is broadcast before rank 0 copies and before its ``SwapDone``, so any later step that
touches those blocks reaches each worker after that worker's copy.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import anyio
import torch
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]  # public API

from asyncpaged._log import get_logger
from asyncpaged.config import EngineConfig, cuda_graph_sizes, kv_head_replicas
from asyncpaged.distributed.commands import (
    CaptureGraphs,
    Command,
    GraphsCaptured,
    RunStep,
    Shutdown,
    SwapCommand,
    WorkerReady,
)
from asyncpaged.distributed.group import INIT_TIMEOUT_S, JOINED_KEY, ProcessGroups, torchrun_env
from asyncpaged.distributed.worker import _spawned_main, build_runner, rank_device, ready_reply
from asyncpaged.errors import InvalidRequestError, WorkerDiedError
from asyncpaged.kv.block_table import SwapDirection
from asyncpaged.model.errors import UnsupportedModelError
from asyncpaged.worker.cuda_graphs import Capture, eager_capture
from asyncpaged.worker.protocol import LateDelivery, StepPlan, StepResult
from asyncpaged.worker.runner import ModelRunner, WorkerSpec, select_attention_backend
from asyncpaged.worker.runner_logs import emit, library_level

log = get_logger(__name__)

JOIN_TIMEOUT_S = 10.0  # a worker told to shut down exits within this, or is terminated


def worker_spec(
    config: EngineConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_device_blocks: int,
    num_host_blocks: int,
    levers: Mapping[str, bool],
    *,
    max_model_len: int = 0,
) -> WorkerSpec:
    """What every rank needs to build its shard, from the engine's settings (resolved dtypes,
    block counts, the CPU levers rank 0 planned; rank 0's torch thread count; the CUDA graphs'
    sizes, for ``max_model_len`` tokens)."""
    lora = config.enable_lora
    return WorkerSpec(
        model=os.fspath(config.model),  # a str once EngineConfig is built
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks,
        block_size=config.block_size,
        device_type=torch.device(config.device).type,
        attention_backend=config.attention_backend,
        packed_linears=levers["packed_linears"],
        fused_elementwise=levers["fused_elementwise"],
        screened_lm_head=levers["screened_lm_head"],
        int8_lm_head=levers["int8_lm_head"],
        native_bf16_decode=levers["native_bf16_decode"],
        seed=config.seed,
        num_threads=torch.get_num_threads(),
        # (the LoRA groups change every step: a LoRA engine's forward runs eagerly)
        cuda_graph_sizes=cuda_graph_sizes(config) if max_model_len and not lora else (),
        max_model_len=max_model_len,
        quantized_activations=config.quantized_activations,
        max_loras=config.max_loras if lora else 0,
        max_lora_rank=config.max_lora_rank if lora else 0,
        max_cpu_loras=(config.max_cpu_loras or config.max_loras) if lora else 0,
    )


def check_tensor_parallel(hf_config: Any, world_size: int) -> None:
    """Raise UnsupportedModelError unless ``world_size`` divides the attention heads, the KV
    heads (or is a multiple of them: each rank then holds one, replicated) and the MLP width
    (checked before any process starts)."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    sizes = {"num_attention_heads": heads}
    if kv_head_replicas(kv_heads, world_size)[1] == 1:  # (else each rank holds one, replicated)
        sizes["num_key_value_heads"] = kv_heads
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        value = getattr(hf_config, name, None)
        if value:
            sizes[name] = int(value)
            break
    else:  # GPT-2 without n_inner: 4 * hidden
        sizes["4 * hidden_size"] = 4 * int(hf_config.hidden_size)
    if getattr(hf_config, "moe_intermediate_size", None):  # Qwen3-MoE experts
        sizes["moe_intermediate_size"] = int(hf_config.moe_intermediate_size)
    bad = {k: v for k, v in sizes.items() if v % world_size}
    if bad:
        raise UnsupportedModelError(
            f"tensor_parallel_size={world_size} must divide the model's "
            + ", ".join(f"{k} ({v})" for k, v in bad.items())
            + "; KV heads are split, or replicated where tensor_parallel_size is a multiple "
            "of them."
        )


class TensorParallelRunner:
    """Rank 0: its ``ModelRunner`` shard and the channel to ranks 1 .. N-1.

    Invariants: commands reach every rank in the order of ``_lock``'s critical sections; once
    ``close`` has run, no command is sent and no worker process is left running (spawned
    workers are joined, terminated if needed); ``ready`` holds one entry per rank, rank order.
    """

    def __init__(
        self,
        runner: ModelRunner,
        groups: ProcessGroups,
        workers: list[BaseProcess],
        ready: list[WorkerReady],
    ) -> None:
        self.runner = runner
        self.ready = tuple(ready)
        self.world_size = groups.world_size
        self._groups = groups
        self._workers = workers
        self._lock = threading.Lock()
        self._closed = False
        self._log = log.bind(actor="tensor_parallel")

    # ---- start --------------------------------------------------------------------------------

    @classmethod
    def start(cls, spec: WorkerSpec, world_size: int, device: str) -> TensorParallelRunner:
        """Start ranks 1 .. N-1 (spawned here, or already launched by torchrun), join the groups,
        send every rank the spec and load rank 0's shard. Blocks until every rank is ready;
        raises (and stops the workers) if any rank fails to start or to load."""
        env = torchrun_env()
        # Rank 0 selects (and, when not cached, compiles) its attention backend before any
        # worker starts, so the workers find the C++ kernel built.
        backend = select_attention_backend(device, spec.attention_backend)
        workers: list[BaseProcess] = []
        store: Store | None = None
        local_rank = 0
        if env is not None:
            if env.world_size != world_size or env.rank != 0:
                raise InvalidRequestError(
                    f"under torchrun (RANK={env.rank}, WORLD_SIZE={env.world_size}) the engine "
                    f"runs on rank 0 with tensor_parallel_size=WORLD_SIZE; got "
                    f"tensor_parallel_size={world_size}. Other ranks call "
                    "asyncpaged.distributed.serve_worker()."
                )
            local_rank = env.local_rank
        else:
            # port 0: the OS picks a free port, so engines never collide on one
            store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=INIT_TIMEOUT_S))  # fmt: skip
            workers = _spawn_workers(world_size, store.port, spec.device_type)
        groups: ProcessGroups | None = None
        try:
            if store is not None:
                _wait_joined(store, workers)
            groups = ProcessGroups(rank=0, world_size=world_size, device_type=spec.device_type,
                                   store=store)  # fmt: skip
            groups.broadcast_spec((spec, library_level()))
            rank0_device = (
                torch.device(device) if env is None else rank_device(spec.device_type, local_rank)
            )
            runner: ModelRunner | None = None
            error: BaseException | None = None
            try:
                runner = build_runner(spec, groups, rank0_device, 0, backend)
            except Exception as exc:  # still gather, so the workers are not left waiting
                error = exc
            ready = groups.gather(ready_reply(0, runner, error))
            assert ready is not None
            replies = [r for r in ready if isinstance(r, WorkerReady)]
            assert len(replies) == world_size, f"bad ready replies {ready}"
            for reply in replies:  # the ranks' load events, through the host's logging
                if reply.logs is not None:
                    emit(reply.logs)
            for reply in replies:
                if reply.error is not None:
                    raise reply.error
            assert runner is not None
        except BaseException:
            _stop(workers, None)
            if groups is not None:
                groups.destroy()
            raise
        log.info("tensor_parallel_started", world_size=world_size,
                 pids=[r.pid for r in replies],
                 kv_cache_bytes=[r.kv_cache_bytes for r in replies])  # fmt: skip
        return cls(runner, groups, workers, replies)

    def capture_cuda_graphs(
        self, sizes: Sequence[int], max_model_len: int, capture: Capture | None = None
    ) -> tuple[int, ...]:
        """Every rank captures the decode graphs of these sizes together (their warm-ups and
        captures run the all-reduces); the sizes captured, as ``ModelRunner``'s, after each
        rank has reported the same ones (the other ranks' capture events are emitted here).
        ``capture``: None (CUDA graphs) or :func:`eager_capture`, which the others also use."""
        if not sizes:
            return ()
        if capture not in (None, eager_capture):
            raise ValueError("tensor-parallel ranks capture CUDA graphs or eager_capture only")
        command = CaptureGraphs(sizes=tuple(sizes), max_model_len=max_model_len,
                                eager=capture is eager_capture)  # fmt: skip
        with self._naming_dead_worker(), self._lock:
            assert not self._closed, "command after close"
            self._groups.broadcast(command)
            captured = self.runner.capture_cuda_graphs(sizes, max_model_len, capture)
            replies = self._groups.gather(GraphsCaptured(rank=0, sizes=captured))
        assert replies is not None
        for reply in replies:
            assert isinstance(reply, GraphsCaptured), f"bad capture reply {reply!r}"
            if reply.logs is not None:
                emit(reply.logs)
            if reply.sizes != captured:  # (a bug: each rank decides from the same facts)
                raise RuntimeError(f"rank {reply.rank} captured CUDA graphs of sizes "
                                   f"{reply.sizes}, rank 0 of {captured}")  # fmt: skip
        return captured

    # ---- the StepRunner interface --------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Broadcast the step, then run rank 0's share of it and sample. Steps run one after
        the other, so what rank 0 sampled last is known here: the other ranks get it in place
        of a row's placeholder."""
        with self._naming_dead_worker():
            self._send(RunStep.of(plan, self.runner.placeholder_values))
            return self.runner.execute(plan)

    def put_late_inputs(self, delivery: LateDelivery) -> None:
        """Rank 0 samples: the bitmasks are its runner's alone."""
        self.runner.put_late_inputs(delivery)

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Every rank copies its share of (device, host) block pairs to its host cache."""
        self._send_swap(SwapCommand(direction=SwapDirection.OUT, pairs=pairs))
        self.runner.swap_out(pairs)

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Every rank copies its share of (host, device) block pairs back to its device cache."""
        self._send_swap(SwapCommand(direction=SwapDirection.IN, pairs=pairs))
        self.runner.swap_in(pairs)

    def _send_swap(self, command: SwapCommand) -> None:
        with self._naming_dead_worker():
            self._send(command)

    @contextlib.contextmanager
    def _naming_dead_worker(self) -> Iterator[None]:
        """A failed collective (RuntimeError) becomes the WorkerDiedError of the worker that
        died, if one did; otherwise the collective's own error stands."""
        try:
            yield
        except RuntimeError as exc:
            died = self._dead_worker()
            if died is None:
                raise
            raise died from exc

    def _send(self, command: Command) -> None:
        with self._lock:
            assert not self._closed, "command after close"
            self._groups.broadcast(command)

    def _dead_worker(self, wait_s: float = 2.0) -> WorkerDiedError | None:
        """After a failed collective: the spawned worker that died, if one did (its exit may
        trail its closed socket by a moment); None when every worker lives on (or under
        torchrun), and the collective's own error stands."""
        deadline = time.monotonic() + wait_s
        while self._workers:
            for rank, proc in enumerate(self._workers, start=1):
                if proc.exitcode is not None:
                    return _died(rank, proc)
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return None

    # ---- liveness and shutdown -----------------------------------------------------------------

    async def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """Until cancelled: when a spawned worker exits, call ``on_death`` at once (the engine
        fails every waiter), then raise :class:`WorkerDiedError`. Under torchrun there is no
        process to watch; a lost rank shows up as a failed collective instead."""
        if not self._workers:
            await anyio.sleep_forever()
        async with anyio.create_task_group() as tg:
            for rank, proc in enumerate(self._workers, start=1):
                tg.start_soon(self._watch_one, rank, proc, on_death)

    async def _watch_one(
        self, rank: int, proc: BaseProcess, on_death: Callable[[BaseException], None]
    ) -> None:
        await anyio.wait_readable(proc.sentinel)
        proc.join(timeout=0.1)  # it has exited: reap it for its exit code
        error = _died(rank, proc)
        self._log.error("tp_worker_died", rank=rank, pid=proc.pid, exitcode=proc.exitcode)
        on_death(error)
        raise error

    def close(self, *, graceful: bool) -> None:
        """Stop every rank (idempotent). ``graceful``: send ``Shutdown`` and let the workers
        leave; otherwise (the engine failed: a collective may be broken) terminate spawned
        workers at once. Either way the spawned processes are joined and the groups destroyed."""
        if self._closed:
            return
        if graceful and all(p.exitcode is None for p in self._workers):
            try:
                self._send(Shutdown())
            except RuntimeError as exc:  # a worker died meanwhile: terminate the rest
                self._log.warning("tp_shutdown_failed", error=repr(exc))
                graceful = False
        self._closed = True
        _stop(self._workers, JOIN_TIMEOUT_S if graceful else None)
        self._groups.destroy()
        self._log.info("tensor_parallel_stopped", graceful=graceful,
                       exitcodes=[p.exitcode for p in self._workers])  # fmt: skip

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the spawned workers (ranks 1 .. N-1); empty under torchrun."""
        return tuple(p.pid for p in self._workers if p.pid is not None)


def _died(rank: int, proc: BaseProcess) -> WorkerDiedError:
    return WorkerDiedError(
        f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
    )


def _spawn_workers(world_size: int, port: int, device_type: str) -> list[BaseProcess]:
    ctx = multiprocessing.get_context("spawn")
    workers: list[BaseProcess] = []
    for rank in range(1, world_size):
        proc = ctx.Process(
            target=_spawned_main,
            args=(rank, world_size, "127.0.0.1", port, device_type),
            name=f"asyncpaged-tp-rank{rank}",
            daemon=True,  # never outlives the engine's process
        )
        proc.start()
        workers.append(proc)
    return workers


def _wait_joined(store: Store, workers: list[BaseProcess]) -> None:
    """Wait until every spawned worker is about to join the groups; fail fast if one exits
    (an import error) instead of waiting for the rendezvous timeout."""
    keys = [JOINED_KEY.format(rank) for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + INIT_TIMEOUT_S
    while not store.check(keys):
        for rank, proc in enumerate(workers, start=1):
            if proc.exitcode is not None:
                raise _died(rank, proc)
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"tensor-parallel workers did not start in {INIT_TIMEOUT_S} s")
        time.sleep(0.02)


def _stop(workers: list[BaseProcess], join_timeout_s: float | None) -> None:
    """Join the workers (after ``join_timeout_s``, or at once: terminate, then kill)."""
    if join_timeout_s is not None:
        deadline = time.monotonic() + join_timeout_s
        for proc in workers:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in workers:
        if proc.exitcode is None:
            proc.terminate()
    for proc in workers:
        proc.join(5.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
