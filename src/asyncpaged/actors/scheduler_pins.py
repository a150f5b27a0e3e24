"""``engine.pin_prefix``'s waiters at the scheduler actor: registered by ``WatchPin``, dropped
by ``ForgetPin``, and answered once a transaction has pinned (or failed to pin) their prefix.
A pin whose waiter is gone is released at once, so no pin outlives its caller's interest: one
made before the ForgetPin came, and one made after."""

from __future__ import annotations

import anyio

from asyncpaged._log import LibraryLogger
from asyncpaged.core.block_table import PinnedPrefix
from asyncpaged.core.scheduler import Scheduler

# pin id -> (the waiter's event, the slot it reads what the pool pinned from)
PinWaiters = dict[int, tuple[anyio.Event, list[PinnedPrefix | None]]]


def hand_out_pins(
    pinned: tuple[tuple[int, PinnedPrefix | None], ...],
    waiters: PinWaiters,
    scheduler: Scheduler,
    log: LibraryLogger,
) -> None:
    """A transaction's pins, each to its waiter (its slot filled, its event set); one whose
    ``pin_prefix`` call has ended (ForgetPin) is unpinned, since nobody holds it."""
    for pin_id, prefix in pinned:
        log.info("prefix_pinned", pin_id=pin_id, num_blocks=len(prefix.block_ids)
                 if prefix else 0)  # fmt: skip
        waiter = waiters.pop(pin_id, None)
        if waiter is None:  # its pin_prefix call ended (ForgetPin): nobody holds the pin
            if prefix is not None:
                scheduler.unpin(prefix.pin_id)
            continue
        event, slot = waiter
        slot.append(prefix)
        event.set()


def forget_pin(
    pin_id: int,
    slot: list[PinnedPrefix | None],
    waiters: PinWaiters,
    scheduler: Scheduler,
) -> None:
    """A ``pin_prefix`` call ended while its slot was empty (ForgetPin): drop its waiter, so
    a pin made later is released by :func:`hand_out_pins`; a pin handed out to the slot in
    between (the call had already ended, so nobody will unpin it) is released now."""
    waiters.pop(pin_id, None)
    prefix = slot[0] if slot else None
    if prefix is not None:
        scheduler.unpin(prefix.pin_id)
