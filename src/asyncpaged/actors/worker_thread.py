"""One long-lived thread per actor for its blocking calls (the forward, the swap copies).

anyio's thread pool hands each call to whichever worker is idle, so one actor's calls wander
across threads as other work (tokenization, grammar compilation) comes and goes. On glibc each
thread allocates from its own arena, and freed memory stays in the arena it came from: a
forward whose activations land in a different arena every few steps keeps a copy of its
high-water mark in each of them (two arenas of ~110-170 MiB each in the soak of issue 25,
RSS still creeping after 30 minutes). One thread per actor keeps its allocations in one arena,
and keeps thread-local state (the current CUDA device and stream, OpenMP's team) stable.
"""

from __future__ import annotations

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


class WorkerThread:
    """Runs blocking calls in order on one thread, each awaited by the caller's task.

    Invariants: at most one call runs at a time, in submission order; a caller's cancellation
    never abandons a running call (the call may be writing memory a later step reads), it is
    delivered once the call returns, like ``anyio.to_thread.run_sync(abandon_on_cancel=False)``;
    the thread exists from the first call until :meth:`close`, and is a daemon so a host that
    never closes the engine can still exit.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the thread; its result, or its exception raised here."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        token = anyio.lowlevel.current_token()
        done = anyio.Event()
        outcome: list[tuple[bool, Any]] = []

        def job() -> None:
            try:
                outcome.append((True, fn(*args)))
            except BaseException as exc:  # delivered to the caller, which decides
                outcome.append((False, exc))
            try:
                anyio.from_thread.run_sync(done.set, token=token)
            except RuntimeError:  # the event loop is gone: nobody is waiting any more
                _log.debug("worker_thread_orphaned", thread=self.name)

        self._jobs.put(job)
        with anyio.CancelScope(shield=True):
            await done.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Let the thread end after the calls already submitted (it is idle once they ran)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
