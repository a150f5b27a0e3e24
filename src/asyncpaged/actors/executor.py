"""The executor actor: runs each step's forward in a worker thread."""

from __future__ import annotations

import time

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged.messages import ExecuteStep, SchedulerInbox, StepDone
from asyncpaged.model.runner import StepRunner


class ExecutorActor:
    """Owns the model and the device KV cache; one step at a time.

    The forward runs in a worker thread (capacity-1 limiter) so the event loop stays free. A
    cancelled engine waits for the running forward to end rather than abandoning the thread,
    which would keep writing the KV cache. ``runner`` is the ``ModelRunner`` itself, or under
    tensor parallelism the rank-0 runner that also broadcasts each step to the other ranks.
    """

    def __init__(
        self,
        runner: StepRunner,
        inbox: MemoryObjectReceiveStream[ExecuteStep],
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
                start = time.perf_counter()
                result = await anyio.to_thread.run_sync(
                    self.runner.execute, msg.plan, limiter=self._limiter, abandon_on_cancel=False
                )
                duration = time.perf_counter() - start
                await self._events.send(
                    StepDone(step_id=msg.output.step_id, result=result, duration_s=duration)
                )
