"""Async scheduling (``EngineConfig(async_scheduling=True)``): a step planned while the one
before runs, its decodes fed the tokens that step samples, inside the runner.

Greedy tokens equal transformers' with the runner on the thread and in its process, under
memory pressure in both preemption modes (preemption waits for the step in flight); a stop
token that ends a sequence leaves the row planned ahead for it computed and discarded and nothing
else; stop strings, seeds and penalties are planned ahead and give the engine's tokens without
it; n > 1 requests (which sit out the step after their fork) run beside the rest; blocks
are free when the last request returns; what "auto" chooses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import (
    EngineConfig,
    EngineStatistics,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    SpeculativeConfig,
)
from asyncpaged.config import async_scheduling_for
from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
from asyncpaged.worker import process as runner_process
from asyncpaged.worker.protocol import SequenceStep, StepPlan
from asyncpaged.worker.runner import ModelRunner
from tests.engine.conftest import running_engine
from tests.engine.test_engine import GREEDY, MODEL, generate_all, make_prompts
from tests.engine.test_prompt_logprobs import assert_matches_transformers
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def sync_and_async(
    path: Path, prompts: list[tuple[int, ...]], params: Callable[[int], SamplingParams], **kw: Any
) -> dict[bool, tuple[list[RequestOutput], EngineStatistics]]:
    """Every prompt at once on an engine without async scheduling, then on one with it: the
    outputs and statistics of each, by ``async_scheduling``."""
    runs = {}
    for ahead in (False, True):
        with anyio.fail_after(180):
            async with running_engine(path, async_scheduling=ahead, **kw) as engine:
                outs = await generate_all(engine, prompts, params)
                runs[ahead] = (outs, engine.statistics())
    return runs


@pytest.mark.parametrize(
    ("backend", "mode"), [("thread", "recompute"), ("thread", "swap"), ("process", "swap")]
)
async def test_greedy_matches_transformers_under_memory_pressure(
    backend: str,
    mode: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(24, seed=1)
    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=10, preemption_mode=mode,
                                  executor_backend=backend,
                                  async_scheduling=True) as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], prompt
    assert stats.num_preemptions > 0
    assert stats.num_steps_planned_ahead > stats.num_steps // 3, stats
    assert stats.num_discarded_rows == 0  # ignore_eos, and max_tokens is known ahead


async def test_priorities_preempt_once_the_step_in_flight_is_back(
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Priority scheduling with steps planned ahead: a plan ahead leaves a priority preemption for
    the next
    plan (after the step in flight), and every request's greedy tokens equal transformers'."""
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(24, seed=3)
    outs: list[Any] = [None] * len(prompts)
    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=10, max_num_seqs=4,
                                  scheduling_policy="priority",
                                  async_scheduling=True) as engine:  # fmt: skip

            async def one(i: int) -> None:
                await anyio.sleep(0.002 * i)  # later ones arrive while others run
                outs[i] = await engine.generate(list(prompts[i]), GREEDY, priority=-i % 5)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], prompt
    assert stats.num_preemptions > 0 and stats.num_steps_planned_ahead > 0, stats


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_a_stop_token_leaves_the_row_planned_ahead_computed_in_vain(
    backend: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Each request stops on its own 4th greedy token (a stop token id): the step planned
    before that token came back computed one more row for it, which changes nothing."""
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(16, seed=2)
    wants = [ref.generate(p, 12)[0] for p in prompts]

    def params(i: int) -> SamplingParams:
        stop = wants[i][3]
        return SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])

    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=64, executor_backend=backend,
                                  async_scheduling=True) as engine:  # fmt: skip
            outs = await generate_all(engine, prompts, params)
            stats = engine.statistics()
    for want, out in zip(wants, outs, strict=True):
        cut = want.index(want[3]) + 1  # the first occurrence of the stop token ends it
        assert out.outputs[0].token_ids == want[:cut]
        assert out.outputs[0].finish_reason == "stop"
    assert stats.num_discarded_rows > 0, stats


async def test_requests_that_cannot_go_ahead_run_beside_those_that_can(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Stop strings, seeded sampling with penalties, n = 2 (sitting out the step after its
    fork) and unseeded sampling (its options fixed) among plain greedy requests: every
    output equals the engine's without async scheduling (seeded and greedy ones; the
    unseeded ones only finish, their draws depend on the order)."""
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(20, seed=3)

    def params(i: int) -> SamplingParams:
        kind = i % 5
        if kind == 1:
            return SamplingParams(temperature=0.0, max_tokens=12, stop=[" the", "e"])
        if kind == 2:
            return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=i,
                                  repetition_penalty=1.2, ignore_eos=True)  # fmt: skip
        if kind == 3:
            return SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=i, ignore_eos=True)
        if kind == 4:
            return SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
        return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    runs = await sync_and_async(path, prompts, params, num_device_blocks=64)
    assert runs[True][1].num_steps_planned_ahead > 0
    results = {ahead: [[c.token_ids for c in o.outputs] for o in outs]
               for ahead, (outs, _) in runs.items()}  # fmt: skip
    for i, (old, new) in enumerate(zip(results[False], results[True], strict=True)):
        if i % 5 == 4:
            assert [len(t) for t in new] == [12]
        else:
            assert new == old, i


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_stop_strings_are_planned_ahead_and_end_where_they_match(
    backend: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Greedy requests with stop strings go ahead like the others: where a string matches, the
    step planned meanwhile computed one row to no use, and the text, tokens and stop reasons equal
    the engine's without async scheduling."""
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(16, seed=11)

    def params(i: int) -> SamplingParams:
        stop = [" the", "e", "s"] if i % 4 else None  # matched early in most texts
        return SamplingParams(temperature=0.0, max_tokens=16, stop=stop, ignore_eos=True)

    runs = await sync_and_async(path, prompts, params, num_device_blocks=64,
                                executor_backend=backend)  # fmt: skip
    results = {ahead: [(c.token_ids, c.text, c.finish_reason, c.stop_reason)
                       for o in outs for c in o.outputs]
               for ahead, (outs, _) in runs.items()}  # fmt: skip
    stats = runs[True][1]
    assert stats.num_steps_planned_ahead > stats.num_steps // 2, stats
    assert stats.num_discarded_rows > 0, stats
    assert results[True] == results[False]
    assert sum(1 for *_, stop in results[True] if stop is not None) >= 4


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_seeded_sampling_is_planned_ahead_with_the_same_tokens(
    backend: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Seeded sampled requests go ahead (their options are fixed: the runner derives each
    draw's generator key from the row's position) and draw exactly the tokens of the engine
    without async scheduling, preemption by recompute included."""
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(24, seed=6)

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=100 + i,
                              ignore_eos=True)  # fmt: skip

    runs = await sync_and_async(path, prompts, params, num_device_blocks=10,
                                executor_backend=backend)  # fmt: skip
    assert all(stats.num_preemptions > 0 for _, stats in runs.values()), runs
    stats = runs[True][1]
    assert stats.num_steps_planned_ahead > stats.num_steps // 3, stats
    tokens = {ahead: [o.outputs[0].token_ids for o in outs] for ahead, (outs, _) in runs.items()}
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize(("backend", "mode"), [("thread", "recompute"), ("process", "swap")])
async def test_penalized_requests_are_planned_ahead_with_the_same_tokens(
    backend: str, mode: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Penalized requests go ahead: a row planned ahead sends its penalty history's tail, and
    the runner adds the token the step in flight samples (``SequenceStep.history``'s
    ``late``). Greedy and seeded sampled ones, with repetition, frequency and presence
    penalties, a min_tokens mask and bad words (whose options come late while they read the
    output: ``late_inputs``), draw exactly the tokens of the engine without async
    scheduling, under preemption."""
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(24, seed=8)

    def params(i: int) -> SamplingParams:
        kind = i % 4
        if kind == 0:
            return SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.3,
                                  ignore_eos=True)  # fmt: skip
        if kind == 1:
            return SamplingParams(temperature=0.9, top_k=20, max_tokens=14, seed=200 + i,
                                  frequency_penalty=0.6, presence_penalty=0.4,
                                  min_tokens=4)  # fmt: skip
        if kind == 2:
            return SamplingParams(temperature=0.0, max_tokens=14, frequency_penalty=1.5,
                                  repetition_penalty=0.8, ignore_eos=True)  # fmt: skip
        return SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.2,
                              bad_words=["the"], ignore_eos=True)  # fmt: skip

    runs = await sync_and_async(path, prompts, params, num_device_blocks=12,
                                executor_backend=backend, preemption_mode=mode)  # fmt: skip
    assert all(stats.num_preemptions > 0 for _, stats in runs.values()), runs
    stats = runs[True][1]
    assert stats.num_steps_planned_ahead > 0, stats
    tokens = {ahead: [o.outputs[0].token_ids for o in outs] for ahead, (outs, _) in runs.items()}
    assert tokens[True] == tokens[False]


async def test_penalized_requests_alone_are_planned_ahead_nearly_always(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """With only penalized requests, every step but the first few is planned ahead of the one
    in flight (the thread runner; plenty of blocks); with bad words too (their banned tokens
    follow the output: the options come late, ``late_inputs``)."""
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(8, seed=9)
    for bad_words in (None, ["the cat", "a"]):

        def params(i: int, bad_words: list[str] | None = bad_words) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3,
                                  frequency_penalty=0.2, bad_words=bad_words,
                                  ignore_eos=True)  # fmt: skip

        runs = await sync_and_async(path, prompts, params, num_device_blocks=64)
        stats = runs[True][1]
        assert stats.num_steps_planned_ahead >= stats.num_steps - 3, stats
        tokens = {ahead: [o.outputs[0].token_ids for o in outs]
                  for ahead, (outs, _) in runs.items()}  # fmt: skip
        assert tokens[True] == tokens[False]


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_prompt_logprobs_requests_are_planned_ahead_with_the_same_outputs(
    backend: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Requests asking prompt logprobs, their prompts chunked 16 tokens a step, some beside
    plain ones: the step that samples a request's first token (its prompt complete) and its
    decodes are planned ahead like any other's, so with prompt logprobs alone nearly every
    step is; the prompt logprobs equal transformers' and the tokens the engine's without
    async scheduling."""
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(8, seed=13, max_len=50)
    for mixed in (False, True):

        def params(i: int, mixed: bool = mixed) -> SamplingParams:
            plp = None if mixed and i % 2 else 1 + i % 3
            return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                  prompt_logprobs=plp)  # fmt: skip

        runs = await sync_and_async(path, prompts, params, num_device_blocks=64,
                                    max_num_batched_tokens=16,
                                    executor_backend=backend)  # fmt: skip
        stats = runs[True][1]
        if not mixed:
            assert stats.num_steps_planned_ahead >= stats.num_steps - 3, stats
        for i, (old, new) in enumerate(zip(runs[False][0], runs[True][0], strict=True)):
            assert new.outputs[0].token_ids == old.outputs[0].token_ids, i
            k = params(i).prompt_logprobs
            if k is None:
                assert new.prompt_logprobs is None
            else:
                assert_matches_transformers(new.prompt_logprobs, list(prompts[i]), ref, k)


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_large_steps_wait_for_the_pipe_and_aborts_free_their_blocks(
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Every step pickles past a tiny ``PIPELINE_BYTES``, so each waits until no reply is
    unread; requests aborted while steps run ahead free their blocks."""
    monkeypatch.setattr(runner_process, "PIPELINE_BYTES", 64)
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(8, seed=6)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=64, executor_backend=backend,
                                  async_scheduling=True) as engine:  # fmt: skip

            async def abort_soon(prompt: tuple[int, ...]) -> None:
                async for out in engine.generate(list(prompt), long):
                    if len(out.outputs[0].token_ids) >= 3:
                        break  # the stream is closed: its request is aborted

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(abort_soon, prompts[i])
                outs = await generate_all(engine, prompts[4:], GREEDY)
            stats = engine.statistics()
    assert stats.num_aborted == 4 and stats.num_steps_planned_ahead > 0, stats
    for prompt, out in zip(prompts[4:], outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0]


def test_async_scheduling_combines_with_everything_else() -> None:
    """Tensor parallelism (rank 0 sends the placeholders), the KV tiers and speculative
    decoding (the steps between proposals go ahead: test_async_speculative) are accepted."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    EngineConfig(model="m", async_scheduling=True, speculative_config=spec)
    EngineConfig(model="m", async_scheduling=True, tensor_parallel_size=2)
    EngineConfig(model="m", async_scheduling=True, kv_offload_host_bytes=1 << 20)


def test_a_late_token_takes_what_the_last_step_sampled(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The runner puts the token it sampled last for a sequence where a row has a placeholder:
    the same logits, K/V and tokens as the row with the real token, in a mixed step too."""
    path = tiny_checkpoint(MODEL)
    runners = [ModelRunner(path, torch.float32, num_blocks=8, block_size=16, kv_fill_value=0.5)
               for _ in range(2)]  # fmt: skip
    prompt = (5, 9, 33, 2, 17, 8)
    other = (40, 41, 42)
    first = StepPlan(seqs=(SequenceStep(1, prompt, 0, tuple(range(6)), (0,), True),))
    sampled = [r.execute(first).sampled[0].token_id for r in runners]
    assert sampled[0] == sampled[1]
    token = sampled[0]
    results = []
    for runner, given in zip(runners, (token, PLACEHOLDER_TOKEN), strict=True):
        step = StepPlan(seqs=(
            SequenceStep(2, other, 0, (16, 17, 18), (1,), True),  # a prefill beside it
            SequenceStep(1, (given,), 6, (6,), (), True, table_start=1),
        ))  # fmt: skip
        results.append([t.token_id for t in runner.execute(step).sampled])
    assert results[0] == results[1]
    for layer in range(runners[0].model.num_layers):
        for a, b in zip(runners[0].kv_cache.layer(layer), runners[1].kv_cache.layer(layer),
                        strict=True):  # fmt: skip
            assert torch.equal(a, b)


async def test_a_request_is_freed_before_its_final_output_while_steps_run_ahead(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """Requests ending on a stop token beside n = 2 requests (sitting out the step after
    their fork) arriving over time, prompts prefilled in chunks: when a request's final
    output reaches its reader, the pool holds no block of it (a finish while a step runs that the
    next cannot be planned ahead of is freed by a transaction of its own)."""
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompts = make_prompts(24, seed=8, max_len=60)
    wants = [ref.generate(p, 8)[0] for p in prompts]
    held: list[str] = []

    def params(i: int) -> SamplingParams:
        kind = RequestOutputKind.DELTA
        if i % 3 == 0:  # n = 2: a fork
            return SamplingParams(temperature=0.8, max_tokens=2, seed=i, ignore_eos=True,
                                  n=2, output_kind=kind)  # fmt: skip
        stop = wants[i][2 + i % 5]  # ends on a stop token, some steps apart
        return SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop],
                              output_kind=kind)  # fmt: skip

    with anyio.fail_after(180):
        async with running_engine(path, num_device_blocks=64, max_num_batched_tokens=24,
                                  async_scheduling=True) as engine:  # fmt: skip
            pool, core = engine._allocator.pool, engine._scheduler.scheduler
            seq_ids: dict[str, int] = {}  # recorded as the core takes each request (a slow
            add_request = core.add_request  # reader may see it first when it has left)

            def recording(request: Any) -> None:
                seq_ids[request.request_id] = request.seqs[0].seq_id
                add_request(request)

            core.add_request = recording  # type: ignore[method-assign]

            async def one(i: int) -> None:
                await anyio.sleep(0.005 * i)
                async for out in engine.generate(list(prompts[i]), params(i)):
                    if out.finished and pool.has_seq(seq_ids[out.request_id]):
                        held.append(out.request_id)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            stats = engine.statistics()
    assert not held, f"requests still holding blocks at their final output: {held}"
    assert stats.num_steps_planned_ahead > 0 and stats.num_discarded_rows > 0, stats


def test_auto_plans_ahead_with_the_runner_in_its_process_only() -> None:
    def resolved(**kw: Any) -> tuple[bool, str]:
        return async_scheduling_for(EngineConfig(model="m", **kw))

    assert resolved(executor_backend="process")[0] is True
    assert resolved(executor_backend="thread")[0] is False
    assert resolved(executor_backend="process", device="cuda")[0] is True  # measured on an H100
    assert resolved(executor_backend="process", device="mps")[0] is False  # not measured
    assert resolved(executor_backend="process", scheduling_policy="priority")[0] is True
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert resolved(executor_backend="process", speculative_config=spec)[0] is True
    assert resolved(executor_backend="thread", speculative_config=spec)[0] is False
    assert resolved(executor_backend="thread", async_scheduling=True) == (True, "configured")
    assert resolved(executor_backend="process", async_scheduling=False) == (False, "configured")
    with pytest.raises(ValueError, match="async_scheduling must be"):
        EngineConfig(model="m", async_scheduling="yes")  # type: ignore[arg-type]
