"""Sharing in the engine: parallel sampling on forked blocks, best_of, tenant-salted prefixes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpaged import BeamSearchParams, InvalidRequestError, RequestOutput, SamplingParams
from asyncpaged._log import get_logger
from asyncpaged.actors.pin_waiters import PinWaiters
from asyncpaged.kv.block_table import PinnedPrefix
from tests.engine.conftest import assert_no_leaks, running_engine
from tests.engine.test_engine import MODEL, generate_all, make_prompts
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class PoolWatcher:
    """Wraps the runner: records the pool's held and shared blocks at every step."""

    def __init__(self, runner: Any, pool: Any) -> None:
        self.runner, self.pool = runner, pool
        self.held: list[int] = []
        self.shared: list[int] = []

    def execute(self, plan: Any) -> Any:
        stats = self.pool.statistics()
        self.held.append(stats.num_held_device_blocks)
        self.shared.append(stats.num_shared_device_blocks)
        return self.runner.execute(plan)

    def __getattr__(self, name: str) -> object:  # the rest of the StepRunner interface
        return getattr(self.runner, name)


async def test_n4_greedy_gives_identical_completions_on_shared_prompt_blocks(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompt = make_prompts(7, seed=11, max_len=60)[-1][:50]
    prompt = prompt + tuple(range(100, 100 + 50 - len(prompt)))  # 50 tokens: 3 full blocks + 2
    params = SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True)
    async with running_engine(path, num_device_blocks=32) as engine:
        watcher = PoolWatcher(engine.runner, engine._allocator.pool)
        engine._executor.runner = watcher  # type: ignore[assignment]
        out = await engine.generate(list(prompt), params)
        stats = engine.statistics()
    want = ref.generate(prompt, 10)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == want for c in out.outputs)
    # 3 full prompt blocks held once + one block per sequence for positions 48..59; without
    # sharing it would be 4 x 4 = 16.
    assert max(watcher.held) == 7
    assert max(watcher.shared) >= 3
    assert stats.num_cow_copies == 3  # the shared partial block: copied by 3 of the 4 writers


async def test_seeded_parallel_sampling_is_the_same_shared_or_not(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint(MODEL)
    prompt = list(make_prompts(1, seed=12)[0]) + [7] * 20
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=7, max_tokens=12,
                            ignore_eos=True)  # fmt: skip
    async with running_engine(path, num_device_blocks=64) as engine:
        alone = await engine.generate(prompt, params)
    # Prefix caching off, other requests around, and memory pressure: preemption by recompute
    # re-prefills each sequence on its own (no fork sharing left).
    others = make_prompts(6, seed=13)
    async with running_engine(path, num_device_blocks=10, enable_prefix_caching=False,
                              preemption_mode="recompute") as engine:  # fmt: skip
        results: list[RequestOutput] = []

        async def main_request() -> None:
            results.append(await engine.generate(prompt, params))

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate_all, engine, others, SamplingParams(max_tokens=12, seed=1))
            tg.start_soon(main_request)
        crowded = results[0]
        assert engine.statistics().num_preemptions > 0
    tokens = [c.token_ids for c in alone.outputs]
    assert tokens == [c.token_ids for c in crowded.outputs]
    assert len({tuple(t) for t in tokens}) > 1  # the samples differ from each other


async def test_best_of_returns_the_n_most_likely_candidates(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint(MODEL)
    prompt = list(make_prompts(1, seed=14)[0])
    common: dict[str, Any] = {"temperature": 1.0, "seed": 3, "max_tokens": 8, "ignore_eos": True}
    async with running_engine(path, num_device_blocks=64) as engine:
        every = await engine.generate(prompt, SamplingParams(n=4, logprobs=0, **common))
        best = await engine.generate(prompt, SamplingParams(n=2, best_of=4, **common))
    ranked = sorted(every.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    scores = [c.cumulative_logprob for c in best.outputs]
    assert scores == pytest.approx([c.cumulative_logprob for c in ranked[:2]], abs=1e-4)


async def test_cache_salt_isolates_tenants(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint(MODEL)
    prompt = list(range(10, 74))  # 64 tokens: 3 blocks can hit (never the last token's block)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    async with running_engine(path, num_device_blocks=64) as engine:
        await engine.generate(prompt, params, cache_salt="tenant-a")
        await engine.generate(prompt, params, cache_salt="tenant-b")
        assert engine.statistics().prefix_cache_hit_tokens == 0
        await engine.generate(prompt, params)
        assert engine.statistics().prefix_cache_hit_tokens == 0
        await engine.generate(prompt, params, cache_salt="tenant-a")
        assert engine.statistics().prefix_cache_hit_tokens == 48


async def test_the_salt_rule_is_the_same_for_every_prompt_form(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """generate and beam_search read a cache salt the same way: from a dict prompt or the
    keyword, refused (before anything is queued) when given both ways, and a dict prompt's salt
    isolates its blocks as the keyword's does."""
    path = tiny_checkpoint(MODEL)
    ids = list(range(10, 74))  # 64 tokens: 3 blocks can hit
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    beams = BeamSearchParams(beam_width=2, max_tokens=2)
    async with running_engine(path, num_device_blocks=64) as engine:

        def submit(form: str, prompt: Any, salt: str | None) -> Any:
            if form == "generate":
                return engine.generate(prompt, greedy, cache_salt=salt)
            return engine.beam_search(prompt, beams, cache_salt=salt)

        for form in ("generate", "beam_search"):
            with pytest.raises(InvalidRequestError, match="cache_salt is given twice"):
                submit(form, {"prompt_token_ids": ids, "cache_salt": "a"}, "b")
            hits = engine.statistics().prefix_cache_hit_tokens
            await submit(form, {"prompt_token_ids": ids, "cache_salt": f"{form}-dict"}, None)
            await submit(form, ids, f"{form}-dict")  # the keyword's salt: the same tenant
            assert engine.statistics().prefix_cache_hit_tokens - hits == 48
            await submit(form, ids, f"{form}-other")
            assert engine.statistics().prefix_cache_hit_tokens - hits == 48
        await engine.wait_idle()
        assert_no_leaks(engine)


async def test_pinned_prefix_survives_eviction_until_unpinned(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prefix = list(range(20, 68))  # 48 tokens: 3 full blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    async with running_engine(path, num_device_blocks=12) as engine:
        handle = await engine.pin_prefix(prefix)
        assert (handle.num_tokens, handle.num_blocks) == (48, 3)
        # Churn through the rest of the cache: unpinned cached blocks get evicted.
        await generate_all(engine, [tuple(range(60 + 40 * i, 100 + 40 * i)) for i in range(6)],
                           greedy)  # fmt: skip
        before = engine.statistics().prefix_cache_hit_tokens
        out = await engine.generate([*prefix, 5, 6, 7], greedy)
        assert engine.statistics().prefix_cache_hit_tokens - before == 48
        assert out.outputs[0].token_ids == ref.generate((*prefix, 5, 6, 7), 6)[0]
        await engine.unpin_prefix(handle)
        with pytest.raises(InvalidRequestError, match="at least one full block"):
            await engine.pin_prefix([1, 2, 3])


async def test_wait_idle_covers_an_unpin_sent_just_before(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """unpin_prefix only posts a message; wait_idle right after it must still wait for the
    unpin's transaction (it once returned with the message unread and the blocks pinned)."""
    async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=12) as engine:
        handle = await engine.pin_prefix(list(range(20, 68)))
        await engine.unpin_prefix(handle)
        await engine.wait_idle()
        assert_no_leaks(engine)


async def test_aborting_a_parallel_sampling_request_frees_all_its_sequences(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint(MODEL)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, ignore_eos=True)
    async with running_engine(path, num_device_blocks=64) as engine:
        stream = engine.generate(list(range(10, 40)), params, request_id="par")
        await anyio.sleep(0.1)
        await engine.abort("par")
        out = await stream
        assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
        assert all(0 < len(c.token_ids) < 200 for c in out.outputs)
    # running_engine's leak oracle: every block of the 3 sequences is free again.


async def test_pin_prefix_fails_instead_of_hanging_when_the_engine_dies_before_the_pin(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The prefix is computed, then the transaction that pins it kills the engine: the caller
    gets EngineDeadError (it used to wait forever for the pin)."""
    from asyncpaged import AsyncEngine, EngineConfig, EngineDeadError

    path = tiny_checkpoint(MODEL)
    with anyio.fail_after(30), pytest.raises(EngineDeadError):
        async with AsyncEngine(EngineConfig(model=str(path), num_device_blocks=32)) as engine:
            pool = engine._allocator.pool

            def broken_pin(*args: object, **kwargs: object) -> None:
                raise RuntimeError("injected pin failure")

            pool.pin_prefix = broken_pin  # type: ignore[method-assign,assignment]
            with pytest.raises(EngineDeadError) as dead:
                await engine.pin_prefix(list(range(20, 68)))
            assert "injected pin failure" in repr(dead.value.__cause__)


@pytest.mark.parametrize("when", ["computing", "after_the_request", "refused"])
async def test_a_pin_prefix_that_does_not_return_leaves_nothing_pinned(
    when: str, tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """Cancelled while its prefix computes, cancelled once its request is done (its pin's
    transaction may or may not have run), or refused (an id outside the vocabulary): the
    engine serves on and, once idle, holds no pinned block (a late pin once crashed the
    scheduler; a pin made for a cancelled caller was never released)."""
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prefix = list(range(20, 68))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with running_engine(path, num_device_blocks=16) as engine:
        wait = engine._wait_or_dead
        scope = anyio.CancelScope()

        async def cancel_then_wait(fn: Any) -> Any:
            scope.cancel()
            return await wait(fn)

        if when == "after_the_request":
            engine._wait_or_dead = cancel_then_wait  # type: ignore[method-assign]
        elif when == "computing":
            scope.deadline = anyio.current_time() + 0.002
        with scope:
            if when == "refused":
                with pytest.raises(InvalidRequestError, match="token ids must be in"):
                    await engine.pin_prefix([*prefix[:-1], 10**6])
            else:
                await engine.pin_prefix(prefix)
        assert scope.cancelled_caught == (when != "refused")
        engine._wait_or_dead = wait  # type: ignore[method-assign]
        out = await engine.generate([*prefix, 5], greedy)
        assert out.outputs[0].token_ids == ref.generate((*prefix, 5), 4)[0]
        await engine.wait_idle()
        assert_no_leaks(engine)  # a leftover pin holds its blocks: neither free nor cached


class _Unpins:
    """The scheduler's ``unpin`` alone, recorded."""

    def __init__(self) -> None:
        self.unpinned: list[int] = []

    def unpin(self, pool_pin_id: int) -> None:
        self.unpinned.append(pool_pin_id)


@pytest.mark.parametrize("order", ["forget_first", "handed_out_first", "kept"])
def test_a_pin_whose_caller_is_gone_is_released_whichever_message_comes_first(
    order: str,
) -> None:
    """``pin_prefix`` gives up while its slot is empty and sends ForgetPin; the pin's
    transaction may hand the pin out before the actor reads that ForgetPin. Either way the
    pin is released exactly once (handed out first, it used to stay pinned with nobody
    holding it: a block held after the engine went idle); a caller that keeps its pin
    releases nothing here."""
    scheduler = _Unpins()
    waiters = PinWaiters(scheduler, get_logger("test"))  # type: ignore[arg-type]
    event, slot = anyio.Event(), []  # type: ignore[var-annotated]
    waiters.watch(7, event, slot)
    pinned = ((7, PinnedPrefix(pin_id=3, block_ids=(1, 2), num_tokens=32)),)
    if order == "forget_first":
        waiters.forget(7, [])
        waiters.hand_out(pinned)
    else:
        waiters.hand_out(pinned)
        assert event.is_set() and slot == [pinned[0][1]]
        if order == "handed_out_first":
            waiters.forget(7, slot)
    assert scheduler.unpinned == ([] if order == "kept" else [3])
    assert not waiters
