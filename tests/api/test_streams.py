"""RequestState wakes its reader when the reader has news, not on every token."""

from __future__ import annotations

import anyio
import pytest

from asyncpaged.sampling_params import RequestOutputKind, SamplingParams
from asyncpaged.streams import RequestState

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _counting_state(monkeypatch: pytest.MonkeyPatch, params: SamplingParams) -> list[int]:
    """Counts the reader's looks at the state (one per wake-up, plus the first)."""
    looks = [0]
    original = RequestState._has_news

    def counted(self: RequestState, kind: RequestOutputKind) -> bool:
        looks[0] += 1
        return original(self, kind)

    monkeypatch.setattr(RequestState, "_has_news", counted)
    return looks


@pytest.mark.parametrize(
    ("kind", "params", "looks_before_end"),
    [
        (RequestOutputKind.FINAL_ONLY, SamplingParams(max_tokens=8), 1),
        # best_of > n is ranked at the end: its reader waits for the end whatever it asked
        (RequestOutputKind.DELTA, SamplingParams(n=1, best_of=2, max_tokens=8), 1),
    ],
)
async def test_end_only_reader_sleeps_through_tokens(
    monkeypatch: pytest.MonkeyPatch,
    kind: RequestOutputKind,
    params: SamplingParams,
    looks_before_end: int,
) -> None:
    looks = _counting_state(monkeypatch, params)
    state = RequestState("r", None, params, arrival_time=0.0)
    done = anyio.Event()

    async def reader() -> None:
        await state.wait(kind)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        for step in range(5):
            for c in state.completions:
                state.add_tokens(c.index, (step,), None, None)
            await anyio.wait_all_tasks_blocked()
        assert looks[0] == looks_before_end
        assert not done.is_set()
        for c in state.completions:
            state.add_tokens(c.index, (9,), "length", None)
        with anyio.fail_after(5):
            await done.wait()
    out = state.snapshot(RequestOutputKind.CUMULATIVE)
    assert [c.token_ids for c in out.outputs] == [[0, 1, 2, 3, 4, 9]] * params.n


async def test_streaming_reader_wakes_on_each_token(monkeypatch: pytest.MonkeyPatch) -> None:
    looks = _counting_state(monkeypatch, SamplingParams(max_tokens=8))
    state = RequestState("r", None, SamplingParams(max_tokens=8), arrival_time=0.0)
    seen: list[list[int]] = []

    async def reader() -> None:
        while True:
            await state.wait(RequestOutputKind.DELTA)
            out = state.snapshot(RequestOutputKind.DELTA)
            seen.append(out.outputs[0].token_ids)
            if out.finished:
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        for step in range(3):
            state.add_tokens(0, (step,), None, None)
            await anyio.wait_all_tasks_blocked()
        state.add_tokens(0, (7,), "length", None)
    assert seen == [[0], [1], [2], [7]]
    assert looks[0] >= 4
