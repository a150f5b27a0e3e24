"""``engine.pin_prefix``'s waiters at the scheduler actor: registered by ``WatchPin``, dropped
by ``ForgetPin``, and answered once a transaction has pinned (or failed to pin) their prefix.

A class of its own, held by the actor: the waiters and the rule that releases a pin nobody
waits for are one piece of state that nothing else of the actor reads (but its idleness: a
waiter left keeps the actor busy)."""

from __future__ import annotations

import anyio

from asyncpaged._log import LibraryLogger
from asyncpaged.kv.block_table import PinnedPrefix
from asyncpaged.sched.scheduler import Scheduler


class PinWaiters:
    """The ``pin_prefix`` calls waiting for their pin, by pin id: each an event and the slot
    it reads what the pool pinned from.

    Invariant: a pin whose waiter is gone is released at once (``Scheduler.unpin``), so no pin
    outlives its caller's interest: one made before the ForgetPin came, and one made after.
    """

    def __init__(self, scheduler: Scheduler, log: LibraryLogger) -> None:
        self._scheduler = scheduler
        self._log = log
        self._waiters: dict[int, tuple[anyio.Event, list[PinnedPrefix | None]]] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    def watch(self, pin_id: int, event: anyio.Event, slot: list[PinnedPrefix | None]) -> None:
        """A ``pin_prefix`` call waits for pin ``pin_id`` (``WatchPin``)."""
        self._waiters[pin_id] = (event, slot)

    def hand_out(self, pinned: tuple[tuple[int, PinnedPrefix | None], ...]) -> None:
        """A transaction's pins, each to its waiter (its slot filled, its event set); one whose
        ``pin_prefix`` call has ended (ForgetPin) is unpinned, since nobody holds it."""
        for pin_id, prefix in pinned:
            self._log.info("prefix_pinned", pin_id=pin_id, num_blocks=len(prefix.block_ids)
                           if prefix else 0)  # fmt: skip
            waiter = self._waiters.pop(pin_id, None)
            if waiter is None:  # its pin_prefix call ended (ForgetPin): nobody holds the pin
                if prefix is not None:
                    self._scheduler.unpin(prefix.pin_id)
                continue
            event, slot = waiter
            slot.append(prefix)
            event.set()

    def forget(self, pin_id: int, slot: list[PinnedPrefix | None]) -> None:
        """A ``pin_prefix`` call ended while its slot was empty (ForgetPin): drop its waiter,
        so a pin made later is released by :meth:`hand_out`; a pin handed out to the slot in
        between (the call had already ended, so nobody will unpin it) is released now."""
        self._waiters.pop(pin_id, None)
        prefix = slot[0] if slot else None
        if prefix is not None:
            self._scheduler.unpin(prefix.pin_id)
