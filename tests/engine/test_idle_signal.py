"""``IdleSignal``: every waiter wakes at an idle moment, whenever it started waiting."""

from __future__ import annotations

import anyio
import pytest

from asyncpaged.actors.idle import IdleSignal

pytestmark = pytest.mark.anyio


async def test_every_waiter_wakes_and_a_late_one_waits_for_the_next_idle_moment() -> None:
    busy = [True]
    signal = IdleSignal(lambda: not busy[0])
    woken: list[str] = []

    async def waiter(name: str) -> None:
        await signal.wait()
        woken.append(name)

    with anyio.fail_after(5):  # a waiter left on a replaced event would hang
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "a")
            tg.start_soon(waiter, "b")
            await anyio.wait_all_tasks_blocked()
            signal.notify()  # still busy: nobody wakes
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            busy[0] = False
            signal.notify()
    assert sorted(woken) == ["a", "b"]

    # The idle moment has passed (its event is set) and the actor is busy again: a new waiter
    # must not return at once on the old event, and wakes at the next idle notify.
    busy[0] = True
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "c")
        await anyio.wait_all_tasks_blocked()
        assert woken[-1] != "c"
        busy[0] = False
        signal.notify()
    assert woken[-1] == "c"
    with anyio.fail_after(1):
        await signal.wait()  # idle now: returns at once
