"""The engine's actors at run time, for :class:`asyncpaged.engine.AsyncEngine`: the engine's own
task that holds them (:class:`ActorTask`), the supervisor that turns an actor's failure into
the engine's (every waiter learns why; the host is not cancelled), and the steps of a close
beyond the engine's own state: the KV tiers written to disk, the worker processes (the
tensor-parallel ranks, or the runner's own process) joined.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from asyncpaged._detached import spawn_detached
from asyncpaged.actors.output_processor import OutputProcessor
from asyncpaged.actors.scheduler import SchedulerActor
from asyncpaged.core.block_pool import BlockPool
from asyncpaged.model.kv_tier_remote import RemoteTierStore, TierStore

__all__ = [
    "ActorTask",
    "RemoteWorkers",
    "close_workers",
    "failure_cause",
    "persist_kv_tiers",
    "supervise_actors",
    "wait_actors_idle",
    "wait_or_dead",
]

ActorRun = Callable[..., Coroutine[Any, Any, None]]  # an actor's ``run(task_status=...)``


class RemoteWorkers(Protocol):
    """Processes the engine started for its model (the tensor-parallel ranks, or the runner's
    own process): watched while the engine runs, stopped when it closes."""

    async def watch(self, on_death: Callable[[BaseException], None]) -> None: ...

    def close(self, *, graceful: bool) -> None: ...


class ActorTask:
    """The engine's own task (:func:`spawn_detached`): it holds the actors' task group from
    :meth:`start` until :meth:`stop`, so whichever task started the engine, any task may close
    it. The task never raises: an actor's failure to start is kept in ``start_error``.

    Invariants: ``tg`` is set once every actor has started, and stays set; once :meth:`stop`
    returns, the task group has exited.
    """

    def __init__(self) -> None:
        self.tg: TaskGroup | None = None
        self.start_error: Exception | None = None  # the actors failed to start
        self._stop = anyio.Event()  # aclose asks the task to stop the actors
        self._ready = anyio.Event()  # the actors started, or failed to
        self._done = anyio.Event()  # the task group has exited

    async def start(
        self,
        actor_runs: Sequence[ActorRun],
        workers: RemoteWorkers | None,
        fail: Callable[[BaseException], None],
    ) -> None:
        """Spawn the task and wait until the actors have started, or failed to. If cancelled
        meanwhile, the actors are stopped (shielded) before the cancellation propagates."""
        spawn_detached(lambda: self._own(actor_runs, workers, fail))
        try:
            await self._ready.wait()
        except BaseException:  # cancelled while the actors start: stop them, then propagate
            await self.stop()
            raise

    async def stop(self) -> None:
        """Cancel the actors and wait until their task group has exited (shielded)."""
        self._stop.set()  # the task cancels the actors and exits their group
        with anyio.CancelScope(shield=True):
            await self._done.wait()

    async def _own(
        self,
        actor_runs: Sequence[ActorRun],
        workers: RemoteWorkers | None,
        fail: Callable[[BaseException], None],
    ) -> None:
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(supervise_actors, actor_runs, workers, fail)
                self.tg = tg
                self._ready.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        except Exception as exc:  # an actor failed to start: the engine's start raises it
            self.start_error = exc
        finally:
            self._ready.set()
            self._done.set()


async def supervise_actors(
    actor_runs: Sequence[ActorRun],
    workers: RemoteWorkers | None,
    fail: Callable[[BaseException], None],
    *,
    task_status: TaskStatus[None],
) -> None:
    """Start each actor's ``run`` in order (and the worker processes' watchdog) and run them; on
    failure call ``fail`` with the cause (:func:`failure_cause`) instead of cancelling the
    host."""
    try:
        async with anyio.create_task_group() as tg:
            for run in actor_runs:
                await tg.start(run)
            if workers is not None:
                tg.start_soon(workers.watch, fail)
            task_status.started()
    except Exception as exc:  # the engine failed: every waiter learns why
        fail(failure_cause(exc))


_CONSEQUENCES = (anyio.BrokenResourceError, anyio.ClosedResourceError)


def failure_cause(exc: Exception) -> Exception:
    """What failed the actors' task group: groups unwrapped down to one error where they hold
    one, after dropping the broken or closed channels of actors whose peer had failed first
    (those come only as its consequences, and race it: they may or may not be in the group)."""
    while isinstance(exc, ExceptionGroup):
        consequences, rest = exc.split(_CONSEQUENCES)
        if consequences is not None and rest is not None:
            exc = rest  # the consequences dropped
        elif len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        else:
            break
    return exc


async def wait_or_dead(wait: Callable[[], Awaitable[object]], dead: anyio.Event) -> None:
    """Await ``wait()`` until it returns or ``dead`` is set (the engine failed, after which
    ``wait()`` may never return)."""
    async with anyio.create_task_group() as tg:

        async def stop_when_dead() -> None:
            await dead.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(stop_when_dead)
        await wait()
        tg.cancel_scope.cancel()


async def close_workers(workers: RemoteWorkers | None, *, graceful: bool) -> None:
    """Stop and join the worker processes (shielded: runs even when cancelled)."""
    if workers is not None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(lambda: workers.close(graceful=graceful))


async def persist_kv_tiers(store: TierStore | None, pool: BlockPool) -> None:
    """At close, with nothing running: write the cached device blocks and the host tier
    to the disk tier (docs/architecture.md, "KV tiers"), in a worker thread (or in the
    runner's process, where the store lives with ``executor_backend="process"``)."""
    if store is None or not store.has_disk:
        return
    pool.begin_tier_txn(store.take_failed_spills())
    ops = pool.persist_tiers()
    if isinstance(store, RemoteTierStore):
        with anyio.CancelScope(shield=True):
            await store.run(ops)
    else:
        await anyio.to_thread.run_sync(store.run, ops, abandon_on_cancel=False)


async def wait_actors_idle(scheduler: SchedulerActor, outputs: OutputProcessor) -> None:
    """Until the scheduler and the output processor are idle at once (the output processor
    sends the scheduler nothing unasked, so once both are, both stay so until new work)."""
    while True:
        await scheduler.wait_idle()
        await outputs.wait_idle()
        if scheduler.is_idle:
            return
