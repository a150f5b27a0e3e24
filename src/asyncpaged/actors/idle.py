"""An actor's "nothing left to do" signal, for any number of waiters."""

from __future__ import annotations

from collections.abc import Callable

import anyio


class IdleSignal:
    """Wakes every waiter once ``is_idle()`` holds at a :meth:`notify`.

    Invariant: ``_event`` is the event the next :meth:`notify` with ``is_idle()`` true sets. A
    waiter replaces it only when it is already set (an idle moment that has passed), so two
    waiters never wait on different events and neither is left behind.
    """

    def __init__(self, is_idle: Callable[[], bool]) -> None:
        self._is_idle = is_idle
        self._event = anyio.Event()

    async def wait(self) -> None:
        """Until the actor is idle (at once when it is now)."""
        while not self._is_idle():
            if self._event.is_set():
                self._event = anyio.Event()
            await self._event.wait()

    def notify(self) -> None:
        """The actor's state changed: wake the waiters if it is idle now."""
        if self._is_idle():
            self._event.set()
