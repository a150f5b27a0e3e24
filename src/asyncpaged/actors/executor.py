"""The executor actor: runs each step's forward on its own thread."""

from __future__ import annotations

import time

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged.actors.worker_thread import WorkerThread
from asyncpaged.messages import ExecuteStep, SchedulerInbox, StepDone
from asyncpaged.model.runner import StepRunner
from asyncpaged.model.runner_process import RunnerProcess


class ExecutorActor:
    """Owns the model and the device KV cache; one step at a time.

    The forward runs on the actor's own long-lived thread (:class:`WorkerThread`) so the event
    loop stays free and the activations stay in one allocator arena. A cancelled engine waits
    for the running forward to end rather than abandoning the thread, which would keep writing
    the KV cache. ``runner`` is the ``ModelRunner`` itself, or under
    tensor parallelism the rank-0 runner that also broadcasts each step to the other ranks; a
    :class:`RunnerProcess` (the runner in its own process) is awaited on the loop, no thread.
    """

    def __init__(
        self,
        runner: StepRunner | RunnerProcess,
        inbox: MemoryObjectReceiveStream[ExecuteStep],
        events: MemoryObjectSendStream[SchedulerInbox],
    ) -> None:
        self.runner = runner
        self._inbox = inbox
        self._events = events
        self._thread = WorkerThread("asyncpaged-executor")

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with self._inbox, self._events:
                async for msg in self._inbox:
                    await self._step(msg)
        finally:
            self._thread.close()

    async def _step(self, msg: ExecuteStep) -> None:
        start = time.perf_counter()
        if isinstance(self.runner, RunnerProcess):
            result = await self.runner.execute(msg.plan)
        else:
            result = await self._thread.run(self.runner.execute, msg.plan)
        duration = time.perf_counter() - start
        await self._events.send(
            StepDone(step_id=msg.output.step_id, result=result, duration_s=duration)
        )
