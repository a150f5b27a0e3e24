"""Killing an engine's worker process (a tensor-parallel rank, the runner's own process) while
requests run or while it is idle: every waiter must learn at once (``EngineDeadError`` caused by
``WorkerDiedError``), nothing may hang, and the process must be reaped."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineDeadError, SamplingParams
from asyncpaged.errors import WorkerDiedError

DEADLINE_S = 5.0  # a waiter learns of the death within this


@dataclass
class Death:
    """What the waiters saw: how long after the kill each learned, and the errors of the
    requests' waiters."""

    delays: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


async def kill_worker(
    engine: AsyncEngine,
    pid: int,
    when: str,
    prompts: Sequence[tuple[int, ...]],
    params: SamplingParams,
    *,
    wait_idle: bool = False,
) -> Death:
    """SIGKILL ``pid`` once ``prompts`` are decoding (``when="mid_run"``; ``wait_idle``: a
    ``wait_idle`` caller waits too) or with nothing in flight (``"idle"``: only the watchdog can
    notice, and a later ``generate`` is refused)."""
    death, killed = Death(), [0.0]

    async def wait_for(prompt: tuple[int, ...]) -> None:
        with pytest.raises(EngineDeadError) as info:
            await engine.generate(list(prompt), params)
        death.delays.append(time.monotonic() - killed[0])
        death.errors.append(info.value)

    async def wait_for_idle() -> None:
        await anyio.sleep(0.05)  # the requests are in
        with pytest.raises(EngineDeadError):
            await engine.wait_idle()
        death.delays.append(time.monotonic() - killed[0])

    if when == "idle":
        os.kill(pid, signal.SIGKILL)
        killed[0] = time.monotonic()
        with anyio.fail_after(DEADLINE_S):
            while engine._dead is None:
                await anyio.sleep(0.01)
        death.delays.append(time.monotonic() - killed[0])
        with pytest.raises(EngineDeadError):
            engine.generate([5, 6, 7], params)
        return death
    async with anyio.create_task_group() as tg:
        for prompt in prompts:
            tg.start_soon(wait_for, prompt)
        if wait_idle:
            tg.start_soon(wait_for_idle)
        while engine.statistics().num_steps < 8:  # decoding, mid-run
            await anyio.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        killed[0] = time.monotonic()
    return death


def assert_died_well(
    exit_error: BaseException, pid: int, when: str, death: Death, num_prompts: int
) -> None:
    """The engine's exit names the dead process; every request's waiter failed with its cause,
    in time; the process is reaped (no zombie, no child left)."""
    assert isinstance(exit_error.__cause__, WorkerDiedError)
    assert f"pid {pid}" in str(exit_error.__cause__)
    if when == "mid_run":
        assert len(death.errors) == num_prompts
        assert all(isinstance(e.__cause__, WorkerDiedError) for e in death.errors), death.errors
    assert death.delays and max(death.delays) < DEADLINE_S, death.delays
    assert not Path(f"/proc/{pid}").exists(), f"process {pid} was not reaped (zombie or alive)"
    assert not multiprocessing.active_children()
