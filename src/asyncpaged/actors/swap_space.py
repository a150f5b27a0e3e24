"""The swap-space actor: copies blocks between device and host caches beside the steps."""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged.core.block_table import SwapDirection
from asyncpaged.messages import SchedulerInbox, SwapBlocks, SwapDone
from asyncpaged.model.runner import StepRunner


class SwapSpaceActor:
    """Owns the host KV tensors; runs each swap's copies in its own worker thread.

    The copies touch only blocks the pool holds in flight for the swap, which no step reads or
    writes, so they run concurrently with the executor's forward. Under tensor parallelism the
    runner's ``swap_out`` / ``swap_in`` first send the swap to every other rank (each moves its
    share of the same blocks), ordered with the steps.
    """

    def __init__(
        self,
        runner: StepRunner,
        inbox: MemoryObjectReceiveStream[SwapBlocks],
        events: MemoryObjectSendStream[SchedulerInbox],
    ) -> None:
        self.runner = runner
        self._inbox = inbox
        self._events = events
        self._limiter = anyio.CapacityLimiter(1)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox, self._events:
            async for msg in self._inbox:
                plan = msg.plan
                copy = (
                    self.runner.swap_out
                    if plan.direction is SwapDirection.OUT
                    else self.runner.swap_in
                )
                await anyio.to_thread.run_sync(
                    copy, plan.block_mapping, limiter=self._limiter, abandon_on_cancel=False
                )
                await self._events.send(SwapDone(swap_id=plan.swap_id))
