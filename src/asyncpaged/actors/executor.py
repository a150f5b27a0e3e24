"""The executor actor: runs each step's forward on its own thread (or in the runner's process)."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged.actors.messages import (
    DeliverLate,
    ExecuteStep,
    ExecutorInbox,
    SchedulerInbox,
    StepDone,
)
from asyncpaged.actors.worker_thread import WorkerThread
from asyncpaged.errors import WorkerDiedError
from asyncpaged.worker.process import RunnerProcess
from asyncpaged.worker.protocol import LateDelivery, StepResult, StepRunner

_Started = tuple[ExecuteStep, Any, float]  # a step, its ticket, when it was sent


class ExecutorActor:
    """Owns the model and the device KV cache; steps run one at a time, in the order sent.

    A step starts as soon as it arrives: queued on the actor's own long-lived thread
    (:class:`WorkerThread`), or sent down the pipe of a :class:`RunnerProcess` (no thread),
    even while the step before still runs (async scheduling sends the next step early), so the
    runner goes from one step to the next without waiting for the event loop. A second task
    awaits the started steps in order and reports each (``StepDone``). The thread keeps the
    activations in one allocator arena; a cancelled engine waits for the running forward to
    end rather than abandoning it (it would keep writing the KV cache). ``runner`` is the
    ``ModelRunner`` itself, or under tensor parallelism the rank-0 runner that also broadcasts
    each step to the other ranks.
    """

    def __init__(
        self,
        runner: StepRunner | RunnerProcess,
        inbox: MemoryObjectReceiveStream[ExecutorInbox],
        events: MemoryObjectSendStream[SchedulerInbox],
    ) -> None:
        self.runner = runner
        self._inbox = inbox
        self._events = events
        self._thread = WorkerThread("asyncpaged-executor")
        self._last_done = 0.0  # when the last step ended (a step sent early starts then)
        # the late rows of the steps sent whose late inputs have not been delivered yet
        self._awaiting: deque[tuple[int, ...]] = deque()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        started, to_report = anyio.create_memory_object_stream[_Started](math.inf)
        try:
            async with self._inbox, self._events, anyio.create_task_group() as tg:
                tg.start_soon(self._report, to_report)
                try:
                    async with started:
                        async for msg in self._inbox:
                            if isinstance(msg, DeliverLate):  # for a step sent, maybe running
                                assert msg.delivery.rows == self._awaiting.popleft()
                                await self._deliver(msg.delivery)
                                continue
                            await self._start(msg, started)
                finally:
                    await self._release_waiting_steps()
        finally:
            self._thread.close()

    async def _start(self, msg: ExecuteStep, started: MemoryObjectSendStream[_Started]) -> None:
        sent = time.perf_counter()
        if isinstance(self.runner, RunnerProcess):
            ticket: Any = await self.runner.send_execute(msg.plan)
        else:
            ticket = self._thread.submit(self.runner.execute, msg.plan)
        if msg.plan.late_rows:
            self._awaiting.append(msg.plan.late_rows)
        started.send_nowait((msg, ticket, sent))

    async def _deliver(self, delivery: LateDelivery) -> None:
        if isinstance(self.runner, RunnerProcess):
            await self.runner.send_late_inputs(delivery)
        else:
            self.runner.put_late_inputs(delivery)

    async def _release_waiting_steps(self) -> None:
        """The engine stops (or failed) with steps sent whose late inputs will never come:
        each gets an empty delivery (it samples as planned, to no use), so the running step,
        which a stopping engine waits for, ends."""
        with anyio.CancelScope(shield=True), contextlib.suppress(WorkerDiedError):
            while self._awaiting:
                await self._deliver(LateDelivery(rows=self._awaiting.popleft()))

    async def _report(self, to_report: MemoryObjectReceiveStream[_Started]) -> None:
        """Await each step :meth:`run` started, in order, and report it."""
        async with to_report:
            async for msg, ticket, sent in to_report:
                result: StepResult
                if isinstance(self.runner, RunnerProcess):
                    result = await self.runner.result(ticket)
                else:
                    result = await self._thread.wait(ticket)
                msg.executed.set()
                done = time.perf_counter()
                duration = done - max(sent, self._last_done)  # from when it could start
                self._last_done = done
                report = StepDone(step_id=msg.output.step_id, result=result, duration_s=duration)
                with contextlib.suppress(anyio.BrokenResourceError):  # (the scheduler stopped:
                    self._events.send_nowait(report)  # the steps still running end unread)
