"""One long-lived thread per actor for its blocking calls (the forward, the swap copies).

anyio's thread pool hands each call to whichever worker is idle, so one actor's calls wander
across threads as other work (tokenization, grammar compilation) comes and goes. On glibc each
thread allocates from its own arena, and freed memory stays in the arena it came from: a
forward whose activations land in a different arena every few steps keeps a copy of its
high-water mark in each of them (two arenas of ~110-170 MiB each in a 30-minute soak, RSS
still creeping at its end). One thread per actor keeps its allocations in one arena,
and keeps thread-local state (the current CUDA device and stream, OpenMP's team) stable.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from asyncpaged._log import get_logger

_log = get_logger(__name__)

_Job = Callable[[], None]


class WorkerThreadClosedError(RuntimeError):
    """A call submitted to a :class:`WorkerThread` after :meth:`WorkerThread.close`: its owner
    has stopped (an actor's run ended), so the caller's engine is closing or failing."""


class WorkerThread:
    """Runs blocking calls in order on one thread, each awaited by the caller's task.

    Invariants: at most one call runs at a time, in submission order; a caller cancelled while
    its call waits in the queue takes it out (it never runs); a call that has started is never
    abandoned (it may be writing memory a later step reads), the caller's cancellation is
    delivered once it returns. These are ``anyio.to_thread.run_sync``'s semantics with a
    capacity-1 limiter and ``abandon_on_cancel=False``. The thread exists from the first call
    until :meth:`close` (no call is taken after it), and is a daemon so a host that never
    closes the engine can still exit.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the thread; its result, or its exception raised here. Raises
        :class:`WorkerThreadClosedError` once the thread is closed (before anything is queued)."""
        return await self.wait(self.submit(fn, *args))

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Call:
        """Queue ``fn(*args)`` now, behind the calls already queued (the thread runs them in
        order, one after the other, without waiting for the event loop); :meth:`wait` for it.
        Raises :class:`WorkerThreadClosedError` once the thread is closed."""
        if self._closed:
            raise WorkerThreadClosedError(f"{self.name}: the worker thread is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        call = _Call(fn, args, anyio.lowlevel.current_token())
        self._jobs.put(call.run)
        return call

    async def wait(self, call: _Call) -> Any:
        """The result of a submitted call (or its exception, raised here). Cancelled, it takes
        back a call not yet started, or waits for a started one to end."""
        try:
            await call.done.wait()
        except anyio.get_cancelled_exc_class():
            if call.withdraw():
                raise
            with anyio.CancelScope(shield=True):
                await call.done.wait()
            raise
        return call.outcome()

    def close(self) -> None:
        """Let the thread end after the calls already submitted (it is idle once they ran)."""
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class _Call:
    """One submitted call: queued, then withdrawn (never runs) or started (runs to its end)."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], token: anyio.lowlevel.EventLoopToken
    ) -> None:
        self._fn, self._args, self._token = fn, args, token
        self._lock = threading.Lock()
        self._state = "queued"  # -> "withdrawn" (by the caller) or "started" (by the thread)
        self.done = anyio.Event()
        self._ok = False
        self._value: Any = None

    def withdraw(self) -> bool:
        """Take the call back if it has not started; False once it has (it will finish)."""
        with self._lock:
            if self._state == "queued":
                self._state = "withdrawn"
                return True
            return False

    def outcome(self) -> Any:
        if not self._ok:
            raise self._value
        return self._value

    def run(self) -> None:
        with self._lock:
            if self._state == "withdrawn":
                return
            self._state = "started"
        try:
            self._value, self._ok = self._fn(*self._args), True
        except BaseException as exc:  # delivered to the caller, which decides
            self._value = exc
        _set_soon(self._token, self.done.set)


def _set_soon(token: anyio.lowlevel.EventLoopToken, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the token's event loop soon, without waiting for it (the thread goes on
    to its next call while the loop is busy): asyncio's ``call_soon_threadsafe``, trio's
    ``run_sync_soon``, else anyio's blocking ``from_thread.run_sync``."""
    native: Any = token.native_token
    try:
        if isinstance(native, asyncio.AbstractEventLoop):
            native.call_soon_threadsafe(fn)
        elif hasattr(native, "run_sync_soon"):  # trio's TrioToken
            native.run_sync_soon(fn)
        else:
            anyio.from_thread.run_sync(fn, token=token)
    except Exception:  # the event loop is gone: nobody is waiting any more
        _log.debug("worker_thread_orphaned")
