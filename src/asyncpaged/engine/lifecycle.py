"""The engine's actors at run time, for :class:`AsyncEngine`: the engine's own
task that holds them (:class:`ActorTask`), the supervisor that turns an actor's failure into
the engine's (every waiter learns why; the host is not cancelled), the check that the engine
runs, and the steps of a close beyond the engine's own state: unfinished requests aborted and
waited for, the KV tiers written to disk, the actors stopped, the worker processes (the
tensor-parallel ranks, or the runner's own process) joined.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from asyncpaged._detached import spawn_detached
from asyncpaged._gc import EngineGC
from asyncpaged.actors.output_processor import OutputProcessor
from asyncpaged.actors.scheduler import SchedulerActor
from asyncpaged.errors import EngineClosedError, EngineDeadError
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.streams import RequestState
from asyncpaged.worker.kv_tier_remote import RemoteTierStore, TierStore

__all__ = [
    "ActorTask",
    "RemoteWorkers",
    "check_alive",
    "close_workers",
    "drain",
    "failure_cause",
    "persist_kv_tiers",
    "stop_engine",
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


def check_alive(dead: BaseException | None, *, closed: bool, running: bool) -> None:
    """Raise unless the engine runs: :class:`EngineDeadError` (``dead`` chained) once it failed,
    :class:`EngineClosedError` once closed, or before its actors run (``running``)."""
    if dead is not None:
        raise EngineDeadError("the engine stopped") from dead
    if closed:
        raise EngineClosedError("the engine is not running: it was closed.")
    if not running:
        raise EngineClosedError(
            "the engine is not running: use `async with AsyncEngine(...)` or "
            "`await AsyncEngine.start(...)`."
        )


async def drain(
    live: Iterable[RequestState],
    abort: Callable[[RequestState], None],
    wait_idle: Callable[[], Awaitable[object]],
    tier_store: TierStore | None,
    pool: BlockPool,
) -> None:
    """A close's first steps, on a live engine: abort every unfinished request (wherever it is,
    intake included), wait (60 s at most) until ``wait_idle()`` returns, then write the KV tiers
    to disk (:func:`persist_kv_tiers`)."""
    for state in list(live):
        abort(state)
    with anyio.fail_after(60):
        await wait_idle()
    await persist_kv_tiers(tier_store, pool)


async def stop_engine(
    channels: Iterable[MemoryObjectSendStream[Any]],
    task: ActorTask,
    workers: RemoteWorkers | None,
    engine_gc: EngineGC,
    *,
    dead: anyio.Event,
    done: anyio.Event,
) -> None:
    """A close's last steps, even when cancelled or failing: close the engine's send ends
    (``channels``), stop the actors, then the worker processes (gracefully unless ``dead`` is
    set by then), give back the GC settings and set ``done``."""
    for channel in channels:
        channel.close()
    try:
        await task.stop()  # the engine's task cancels the actors, exits their group
    finally:
        await close_workers(workers, graceful=not dead.is_set())
        engine_gc.close()
        # The stopped tasks' frames (held by their cancellation tracebacks, in cycles) still
        # reference the engine: collect them now, so that the model and KV cache are freed
        # with the engine's last reference, not at some later full collection.
        gc.collect()
        done.set()
