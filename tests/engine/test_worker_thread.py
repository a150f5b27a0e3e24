"""The actors' own threads (``actors/worker_thread.py``): one thread, in order, results and
errors delivered, a cancelled caller waits for a started call and withdraws a queued one,
closed threads end."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from asyncpaged.actors.worker_thread import WorkerThread

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_calls_run_in_order_on_one_thread_that_is_not_the_loop() -> None:
    worker = WorkerThread("test-worker")
    seen: list[tuple[int, int]] = []

    def call(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    results = []
    for i in range(20):
        results.append(await worker.run(call, i))
    worker.close()
    assert results == [i * i for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    threads = {ident for _, ident in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_concurrent_callers_are_served_one_at_a_time() -> None:
    worker = WorkerThread("test-worker")
    running = 0
    most = 0

    def call() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        time.sleep(0.01)
        running -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(worker.run, call)
    worker.close()
    assert most == 1


async def test_an_exception_reaches_the_caller_and_the_thread_serves_on() -> None:
    worker = WorkerThread("test-worker")

    def boom() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        await worker.run(boom)
    assert await worker.run(lambda: 7) == 7
    worker.close()


async def test_a_cancelled_caller_waits_for_its_call_to_end() -> None:
    worker = WorkerThread("test-worker")
    finished = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        finished.set()

    with anyio.move_on_after(0.02) as scope:
        await worker.run(slow)
        await anyio.sleep(1)  # the cancellation lands here, after the call returned
    assert scope.cancelled_caught
    assert finished.is_set()
    worker.close()


async def test_a_caller_cancelled_while_queued_withdraws_its_call() -> None:
    worker = WorkerThread("test-worker")
    release = threading.Event()
    ran: list[str] = []

    def blocker() -> None:
        release.wait(5)
        ran.append("blocker")

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.run, blocker)
        await anyio.sleep(0.05)  # the blocker is running
        with anyio.move_on_after(0.05) as scope:
            await worker.run(ran.append, "queued")
        assert scope.cancelled_caught  # returned while the blocker still runs
        release.set()
    assert await worker.run(lambda: 3) == 3  # the thread served on, past the withdrawn call
    worker.close()
    assert ran == ["blocker"]


async def test_close_ends_the_thread() -> None:
    worker = WorkerThread("test-worker-close")
    await worker.run(lambda: None)
    worker.close()
    deadline = time.monotonic() + 5
    while any(t.name == "test-worker-close" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the worker thread did not end"
        await anyio.sleep(0.01)


async def test_a_closed_worker_takes_no_call() -> None:
    worker = WorkerThread("test-worker")
    await worker.run(lambda: None)
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        await worker.run(lambda: None)


async def test_submitted_calls_run_back_to_back_while_the_loop_is_busy() -> None:
    """``submit`` queues at once; the thread goes on to the next call without waiting for the
    event loop to take the last result (async scheduling queues a step behind the running
    one), under asyncio and trio alike."""
    worker = WorkerThread("test-worker")
    times: dict[str, float] = {}

    def first() -> str:
        time.sleep(0.05)
        times["first_end"] = time.perf_counter()
        return "a"

    def second() -> str:
        times["second_start"] = time.perf_counter()
        return "b"

    calls = [worker.submit(first), worker.submit(second)]
    time.sleep(0.4)  # the loop is busy (blocked) while both run
    assert [await worker.wait(c) for c in calls] == ["a", "b"]
    worker.close()
    assert times["second_start"] - times["first_end"] < 0.2
