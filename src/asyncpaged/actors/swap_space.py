"""The swap-space actor: copies blocks between device and host caches beside the steps."""

from __future__ import annotations

from typing import assert_never

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged.actors.messages import (
    CopyTierBlocks,
    SchedulerInbox,
    SwapBlocks,
    SwapDone,
    SwapSpaceInbox,
)
from asyncpaged.actors.worker_thread import WorkerThread
from asyncpaged.kv.block_table import SwapDirection
from asyncpaged.worker.kv_tier_remote import RemoteTierStore, TierStore
from asyncpaged.worker.process import RunnerProcess
from asyncpaged.worker.protocol import StepRunner


class SwapSpaceActor:
    """Owns the host KV tensors; runs each swap's copies on its own thread (:class:`WorkerThread`).

    The copies touch only blocks the pool holds in flight for the swap, which no step reads or
    writes, so they run concurrently with the executor's forward. Under tensor parallelism the
    runner's ``swap_out`` / ``swap_in`` first send the swap to every other rank (each moves its
    share of the same blocks), ordered with the steps. A :class:`RunnerProcess` runs the copies
    in its own process, in order with the steps sent before them.

    KV-tier copies (:class:`CopyTierBlocks`, with ``tier_store``) run in the same thread (or
    the runner's process, where a :class:`RemoteTierStore` sends them), after every swap sent
    before them; the scheduler waits for them before it starts their step, so
    they never race a forward (an offloaded block is about to be reused, a restored one read).
    """

    def __init__(
        self,
        runner: StepRunner | RunnerProcess,
        inbox: MemoryObjectReceiveStream[SwapSpaceInbox],
        events: MemoryObjectSendStream[SchedulerInbox],
        tier_store: TierStore | None = None,
    ) -> None:
        self.runner = runner
        self.tier_store = tier_store
        self._inbox = inbox
        self._events = events
        self._thread = WorkerThread("asyncpaged-swap")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with self._inbox, self._events:
                async for msg in self._inbox:
                    match msg:
                        case SwapBlocks(plan=plan):
                            await self._swap(plan.direction, plan.block_mapping)
                            await self._events.send(SwapDone(swap_id=plan.swap_id))
                        case CopyTierBlocks(ops=ops, done=done):
                            store = self.tier_store
                            assert store is not None, "KV-tier copies without a tier store"
                            if isinstance(store, RemoteTierStore):  # in the runner's process
                                await store.run(ops)
                            else:
                                await self._thread.run(store.run, ops)
                            done.set()
                        case _:
                            assert_never(msg)
        finally:
            self._thread.close()

    async def _swap(self, direction: SwapDirection, pairs: tuple[tuple[int, int], ...]) -> None:
        runner = self.runner
        if isinstance(runner, RunnerProcess):
            await (runner.swap_out if direction is SwapDirection.OUT else runner.swap_in)(pairs)
        else:
            copy = runner.swap_out if direction is SwapDirection.OUT else runner.swap_in
            await self._thread.run(copy, pairs)
