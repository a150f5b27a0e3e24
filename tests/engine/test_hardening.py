"""Hardening: a hostile request fails alone, aborts are honoured in every stage, idle counts
intake, nothing per-request blocks the host loop, dropped streams abort, GC is frozen.

Every test keeps an innocent "victim" request in flight that must finish token-identical to
transformers, on asyncio and trio, and ends with the leak oracle (``running_engine``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from asyncpaged import EngineConfig, InvalidRequestError, RequestOutput, SamplingParams
from asyncpaged.sampling_params import BeamSearchParams
from asyncpaged.sched.request import RequestStatus
from tests.engine.conftest import running_engine
from tests.model.reference import HFReference

MODEL = "llama-gqa"
VICTIM = (5, 6, 7, 8)
LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
BACKENDS = ["asyncio", "trio"]


class SlowTokenizer:
    """The engine's tokenizer, but ``encode`` of a text containing ``slow_marker`` sleeps
    first (in the intake's worker thread) and of one containing ``fail_marker`` raises, as a
    tokenizer can on input it does not take."""

    def __init__(self, tokenizer: Any, delay_s: float = 0.5) -> None:
        self._tokenizer = tokenizer
        self.delay_s = delay_s

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        if "SLOW" in text:
            time.sleep(self.delay_s)
        if "FAIL" in text:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def run(backend: str, main: Callable[[], Awaitable[None]]) -> None:
    anyio.run(main, backend=backend)


async def finish(stream: Any) -> RequestOutput:
    with anyio.fail_after(30):
        out: RequestOutput = await stream
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_requests_fail_alone_and_the_victim_completes(
    backend: str, tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    want = ref.generate(VICTIM, 60)[0]
    sampled = SamplingParams(temperature=1.0, max_tokens=3)
    refused: list[tuple[Callable[[Any], object], str]] = [
        (lambda e: e.generate("ab\ud800cd", LONG), "lone surrogate"),
        (lambda e: e.generate([5, 6], LONG, cache_salt=3), "cache_salt"),
        (lambda e: e.generate([5, 6], LONG, cache_salt=b"x"), "cache_salt"),
        (lambda e: e.generate([5, 6], LONG, cache_salt="a\ud800"), "cache_salt"),
        (lambda e: e.generate({"prompt": "hi", "cache_salt": "\ud800"}, LONG), "cache_salt"),
        (
            lambda e: e.generate(
                [5, 6], SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[10**6])
            ),
            "stop_token_ids",
        ),
        (lambda e: e.generate([5, 6], SamplingParams(n=8, temperature=1.0)), "max_num_seqs"),
        (lambda e: e.generate([5, 6], SamplingParams(n=2, best_of=8, temperature=1.0)), "best_of"),
        (lambda e: e.beam_search([5, 6], BeamSearchParams(beam_width=8, max_tokens=3)), "beam"),
        (lambda e: e.generate("hello", SamplingParams(n=10**6, temperature=1.0)), "n=1000000"),
        (lambda e: e.generate(None, sampled), "a prompt must be"),
        (lambda e: e.generate(5, sampled), "a prompt must be"),
        (lambda e: e.generate(1.5, sampled), "a prompt must be"),
        (lambda e: e.generate(b"abc", sampled), "a prompt must be"),
        (lambda e: e.generate({5: 1}, sampled), "a prompt must be"),
        (lambda e: e.generate([True, False], sampled), "bool"),
        (lambda e: e.generate(np.array([True, False]), sampled), "integers"),
        (lambda e: e.generate(torch.tensor([5.0, 6.0]), sampled), "integers"),
        (lambda e: e.generate(torch.tensor([[5, 6]]), sampled), "1-D"),
        (lambda e: e.generate([5, 6], sampled, request_id=["x"]), "request_id"),
        (lambda e: e.generate([5, 6], sampled, request_id="a\ud800"), "request_id"),
        (lambda e: e.generate([5, 6], SamplingParams(stop=123)), "stop must be"),  # type: ignore[arg-type]
    ]

    async def main() -> None:
        async with running_engine(path, num_device_blocks=64, max_num_seqs=4) as engine:
            victim = engine.generate(list(VICTIM), LONG, request_id="victim")
            for make, match in refused:
                with pytest.raises(InvalidRequestError, match=match):
                    make(engine)
            # What the tokenizer raises is its request's failure (awaited), not the engine's.
            engine._intake.tokenizer = SlowTokenizer(engine.tokenizer)
            with pytest.raises(InvalidRequestError, match="tokenizer failed"):
                await finish(engine.generate("FAIL here", sampled))
            # Integer arrays and tensors are token ids, as their lists are.
            by_list = await finish(engine.generate([5, 6, 7], LONG))
            arrays: list[Any] = [np.array([5, 6, 7]), torch.tensor([5, 6, 7], dtype=torch.int32)]
            for ids in arrays:
                out = await finish(engine.generate(ids, LONG))
                assert out.outputs[0].token_ids == by_list.outputs[0].token_ids
            got = await finish(victim)
            assert got.outputs[0].token_ids == want

    run(backend, main)


async def _status(engine: Any, rid: str, status: RequestStatus, timeout_s: float = 20) -> None:
    with anyio.fail_after(timeout_s):
        while True:
            request = engine._scheduler.scheduler.requests.get(rid)
            if request is not None and request.status is status:
                return
            await anyio.sleep(0.0005)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aborts_are_honoured_in_every_stage(
    backend: str, tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    want = ref.generate(VICTIM, 60)[0]
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)

    async def main() -> None:
        async with running_engine(path, num_device_blocks=64, max_num_seqs=2) as engine:
            engine._intake.tokenizer = SlowTokenizer(engine.tokenizer, delay_s=0.3)
            victim = engine.generate(list(VICTIM), LONG, request_id="victim")
            # In intake (the tokenizer is busy with it): abort(), a cancelled waiter, aclose().
            s1 = engine.generate("SLOW one", params, request_id="intake-abort")
            await engine.abort("intake-abort")
            s2 = engine.generate("SLOW two", params, request_id="intake-cancel")
            with anyio.move_on_after(0.01):
                await s2
            s3 = engine.generate("SLOW three", params, request_id="intake-close")
            await s3.aclose()
            for stream in (s1, s2):
                out = await finish(stream)
                assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
            # Running, then waiting: both sequence slots held by requests of 150 tokens (the victim
            # may still hold one; the blocker then takes its seat when it ends), whatever the
            # victim's progress.
            runner = engine.generate([9, 10, 11], params, request_id="running")
            blocker = engine.generate([14, 15], params, request_id="blocker")
            await _status(engine, "running", RequestStatus.RUNNING)
            await _status(engine, "blocker", RequestStatus.RUNNING)
            waiter = engine.generate([12, 13], params, request_id="waiting")
            await _status(engine, "waiting", RequestStatus.WAITING)
            for rid in ("waiting", "running", "blocker"):
                await engine.abort(rid)
            for stream in (waiter, runner, blocker):
                out = await finish(stream)
                assert out.outputs[0].finish_reason == "abort"
                assert len(out.outputs[0].token_ids) < 150
            assert (await finish(victim)).outputs[0].token_ids == want
            with anyio.fail_after(10):
                await engine.wait_idle()
            assert engine.statistics().num_aborted == 6

    run(backend, main)


def test_an_abort_reaches_a_swapped_request(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = [tuple(range(20 + 7 * i, 50 + 7 * i)) for i in range(4)]  # 30 tokens + 40 new
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main() -> None:
        async with running_engine(path, num_device_blocks=10, preemption_mode="swap") as engine:
            streams = [
                engine.generate(list(p), params, request_id=f"r{i}") for i, p in enumerate(prompts)
            ]
            with anyio.fail_after(30):
                while True:  # abort the first request seen swapped out
                    swapped = [
                        r.request_id
                        for r in engine._scheduler.scheduler.swapped
                        if r.status is RequestStatus.SWAPPED
                    ]
                    if swapped:
                        break
                    await anyio.sleep(0.0005)
            await engine.abort(swapped[0])
            for i, stream in enumerate(streams):
                out = await finish(stream)
                if f"r{i}" == swapped[0]:
                    assert out.outputs[0].finish_reason == "abort"
                else:
                    assert out.outputs[0].token_ids == ref.generate(prompts[i], 40)[0]

    run("asyncio", main)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wait_idle_counts_intake_and_wakes_every_waiter(
    backend: str, tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    want = ref.generate(VICTIM, 60)[0]

    async def main() -> None:
        async with running_engine(path, num_device_blocks=64) as engine:
            engine._intake.tokenizer = SlowTokenizer(engine.tokenizer, delay_s=0.3)
            victim = engine.generate(list(VICTIM), LONG, request_id="victim")
            text = engine.generate("SLOW the block table", SamplingParams(max_tokens=4))
            returned: list[str] = []

            async def waiter(name: str) -> None:
                await engine.wait_idle()
                assert text._state.is_done, "wait_idle returned with a request in intake"
                returned.append(name)

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter, "a")
                    tg.start_soon(waiter, "b")
                    await anyio.sleep(0.01)
                    tg.start_soon(waiter, "c")  # joins while the others wait
            assert sorted(returned) == ["a", "b", "c"]
            assert (await finish(victim)).outputs[0].token_ids == want
            await finish(text)

    run(backend, main)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dropped_stream_aborts_its_request(
    backend: str, tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    want = ref.generate(VICTIM, 60)[0]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        async with running_engine(path, num_device_blocks=64) as engine:
            victim = engine.generate(list(VICTIM), LONG, request_id="victim")
            async for _ in engine.generate([9, 10], params, request_id="broken"):
                break  # no aclose(): the stream is dropped here
            engine.generate([11, 12], params, request_id="never-read")  # dropped at once
            gc.collect()
            assert (await finish(victim)).outputs[0].token_ids == want
            with anyio.fail_after(10):
                await engine.wait_idle()
            stats = engine.statistics()
            assert stats.num_aborted == 2 and stats.num_finished == 1

    run(backend, main)


# alone: wall-clock bounds (a refusal within 50 ms, a request past a slow tokenizer within
# 1.5 s) that a test on the other worker, competing for the 2 cores, could push past.
@pytest.mark.alone
def test_huge_requests_are_refused_before_work_and_delay_no_one(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    want = ref.generate(VICTIM, 10)[0]
    short = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def main() -> None:
        async with running_engine(path, num_device_blocks=64) as engine:
            huge_text, huge_ids = "x" * 10_000_000, [5] * 10_000_000
            makers: list[Callable[[], object]] = [
                lambda: engine.generate(huge_text, short),
                lambda: engine.generate(huge_ids, short),
                lambda: engine.generate([5, 6], SamplingParams(n=10**6, temperature=1.0)),
            ]
            for make in makers:
                start = time.perf_counter()
                with pytest.raises(InvalidRequestError):
                    make()
                assert time.perf_counter() - start < 0.05
            # A text prompt that takes the tokenizer a while holds up no prompt of ids.
            engine._intake.tokenizer = SlowTokenizer(engine.tokenizer, delay_s=2.0)
            slow = engine.generate("SLOW the block table", short)
            start = time.perf_counter()
            fast = await finish(engine.generate(list(VICTIM), short))
            assert time.perf_counter() - start < 1.5
            assert fast.outputs[0].token_ids == want
            assert not slow._state.is_done
            await finish(slow)

    run("asyncio", main)


def test_gc_freeze_after_start_and_unfreeze_at_close(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint(MODEL)
    assert gc.get_freeze_count() == 0

    async def main() -> None:
        async with running_engine(path, num_device_blocks=16) as engine:
            assert gc.get_freeze_count() > 10_000  # the model, tokenizer and imports
            await finish(engine.generate([5, 6], SamplingParams(max_tokens=2)))
        assert gc.get_freeze_count() == 0
        async with running_engine(path, num_device_blocks=16, gc_freeze=False):
            assert gc.get_freeze_count() == 0

    run("asyncio", main)


def test_gc_threshold_raised_while_engines_run_and_the_hosts_restored(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The young-collection threshold is ``gc_threshold`` while any engine runs (two nested
    engines: until the second closes), never lowered below the host's, and the host's three
    thresholds are back after the last close; ``gc_threshold=None`` leaves them alone, and so
    does a host that turned automatic collection off (threshold 0)."""
    path = tiny_checkpoint(MODEL)
    host = gc.get_threshold()

    async def main() -> None:
        gc.set_threshold(700, 11, 12)
        async with running_engine(path, num_device_blocks=16) as engine:
            assert gc.get_threshold() == (10_000, 11, 12)
            async with running_engine(path, num_device_blocks=16, gc_threshold=20_000):
                assert gc.get_threshold() == (20_000, 11, 12)
            assert gc.get_threshold() == (20_000, 11, 12)  # (raised while any engine runs)
            await finish(engine.generate([5, 6], SamplingParams(max_tokens=2)))
        assert gc.get_threshold() == (700, 11, 12)
        gc.set_threshold(50_000, 11, 12)
        async with running_engine(path, num_device_blocks=16):
            assert gc.get_threshold() == (50_000, 11, 12)  # the host's, higher, kept
        async with running_engine(path, num_device_blocks=16, gc_threshold=None):
            assert gc.get_threshold() == (50_000, 11, 12)
        assert gc.get_threshold() == (50_000, 11, 12)
        gc.set_threshold(0, 11, 12)  # the host turned automatic collection off
        async with running_engine(path, num_device_blocks=16):
            assert gc.get_threshold() == (0, 11, 12)

    try:
        run("asyncio", main)
    finally:
        gc.set_threshold(*host)
    for bad in (0, -5, 2.5, "10"):
        with pytest.raises(ValueError, match="gc_threshold"):
            EngineConfig(model="m", gc_threshold=bad)  # type: ignore[arg-type]
