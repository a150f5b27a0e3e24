"""A task that belongs to no caller: the engine's own, so that any task may close it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

_asyncio_tasks: set[asyncio.Task[None]] = set()  # referenced until done (asyncio keeps weak refs)


def spawn_detached(fn: Callable[[], Awaitable[None]]) -> None:
    """Start ``fn()`` in a new task of the running event loop, outside every task group of the
    caller: under trio a system task, under asyncio a plain task. ``fn`` must not raise (a
    trio system task's exception crashes the run); it is cancelled when the loop shuts down
    (``asyncio.run`` cancels its remaining tasks, ``trio.run`` its system tasks)."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # trio is imported but this is not its loop
            pass
        else:
            trio.lowlevel.spawn_system_task(fn)
            return

    async def run() -> None:
        await fn()

    task = asyncio.get_running_loop().create_task(run())
    _asyncio_tasks.add(task)
    task.add_done_callback(_asyncio_tasks.discard)
