"""The process groups of a tensor-parallel engine, on torch.distributed.

Two groups over the same N ranks::

    data     the default group: NCCL on CUDA, gloo on CPU. Only the model's all-reduces (two per
             layer), issued by each rank's forward in the same order.
    control  a gloo group: rank 0's commands (``commands.py``), broadcast as pickled objects.

Why two: rank 0 broadcasts swap commands from the swap actor's thread while the executor's
thread is inside a step's all-reduces. On one group those collectives could interleave; on two
they cannot, and a lock on rank 0 orders the commands themselves (so every rank sees steps and
swaps in one order). Pickled objects also need a CPU group under NCCL (vLLM keeps a CPU group for
its metadata for the same reason).

Timeouts: an all-reduce waits at most ``DATA_TIMEOUT_S`` for the other ranks (a backstop: a dead
peer's closed socket fails a gloo collective at once); a worker waits for its next command for
as long as the engine idles (``CONTROL_TIMEOUT_S``), and learns of rank 0's end when its socket
closes. One engine per process may use tensor parallelism at a time (the default group is
per-process); ``destroy`` frees it for the next.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # public API

from asyncpaged.distributed.commands import Command
from asyncpaged.errors import InvalidRequestError

DATA_TIMEOUT_S = 300.0
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0
INIT_TIMEOUT_S = 120.0  # spawned workers import torch and asyncpaged before they join
JOINED_KEY = "asyncpaged/joined/{}"  # a spawned worker's "about to join" mark in rank 0's store


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """The rank of this process in a ``torchrun`` launch (RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """This process's torchrun rank, or None when not launched by torchrun (or torch.distributed
    env:// variables)."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return TorchrunEnv(rank, world, int(env.get("LOCAL_RANK", rank)))


class ProcessGroups:
    """This process's membership in the engine's two groups.

    Invariants: created once per process at a time (torch's default group); every rank creates
    the control group right after the default one, so the calls pair up; after ``destroy`` no
    collective may run.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device_type: str,
        store: Store | None = None,
    ) -> None:
        """Join the groups: through ``store`` (spawned workers: rank 0's TCPStore) or, with no
        store, through torchrun's env:// variables. Blocks until every rank has joined."""
        if dist.is_initialized():
            raise InvalidRequestError(
                "torch.distributed is already initialized in this process: one "
                "tensor-parallel engine per process at a time, and the engine creates the "
                "process groups itself (do not call init_process_group)."
            )
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=None if store is not None else "env://",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=DATA_TIMEOUT_S),
        )
        self.rank, self.world_size = rank, world_size
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
        self._destroyed = False

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (the data group)."""
        dist.all_reduce(tensor)

    def broadcast(self, command: Command) -> None:
        """Rank 0: send ``command`` to every rank (the caller orders concurrent sends)."""
        dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> Command:
        """Another rank: the next command from rank 0 (blocks until one comes)."""
        box: list[Command | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        command = box[0]
        assert command is not None, "rank 0 broadcast nothing"
        return command

    def gather(self, obj: object) -> list[object] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        out: list[object] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def broadcast_spec(self, spec: object | None) -> object:
        """Rank 0's ``spec`` on every rank."""
        box = [spec]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def destroy(self) -> None:
        """Leave both groups (idempotent); local, so it does not wait for dead peers."""
        if not self._destroyed and dist.is_initialized():
            dist.destroy_process_group()
        self._destroyed = True
