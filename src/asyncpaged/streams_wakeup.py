"""The wake-up of a request's one reader (:class:`~asyncpaged.streams.RequestState` holds
one): a bare future on asyncio, an ``anyio.Event`` elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import anyio


class Wakeup:
    """Wakes the one reader of a request: ``wait`` returns at the first ``set`` after it began
    (the reader re-checks its state around it, so a ``set`` with no reader waiting is moot).

    On asyncio the reader awaits a bare future, the cheapest wake-up the loop has (a state is
    woken once per step); on any other loop an ``anyio.Event``. Writer and reader share one
    event loop."""

    __slots__ = ("_event", "_future", "_loop")

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None
        self._event: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | bool | None = None  # False: not asyncio

    def set(self) -> None:
        future, event = self._future, self._event
        if future is not None:
            self._future = None
            if not future.done():
                future.set_result(None)
        if event is not None:
            self._event = None
            event.set()

    def wait(self) -> Awaitable[None]:
        """What to await: the future itself (no coroutine frame of its own to make and resume
        once a step per reader), or the event's wait."""
        loop = self._loop
        if loop is None:
            try:
                loop = self._loop = asyncio.get_running_loop()
            except RuntimeError:  # trio, or another loop anyio runs on
                loop = self._loop = False
        if loop:
            assert isinstance(loop, asyncio.AbstractEventLoop)
            future = self._future = loop.create_future()
            return future
        event = self._event = anyio.Event()
        return event.wait()
