"""Async scheduling with sampling that reads the token in flight: a decode is planned ahead of
the step that samples its input token, and what its sampling needs of that token (a grammar's
bitmask; options that read the output: bad words, min_tokens, logits processors) is made
once that step is back and reaches the runner while the forward runs (``late_inputs``); a
grammar that forces tokens after that input (jump-forward) voids the sample planned ahead,
and the next plan computes the forced tokens.

The oracle is the engine without async scheduling: greedy and seeded sampled JSON requests,
beside plain ones, draw exactly its tokens with the runner on the thread and in its process,
jump-forward on and off, under preemption, and every JSON object that ends validates; so do
requests with bad words, min_tokens and logits processors, each processor called once per
token drawn. Parallel sampling (n > 1, best_of) goes ahead once it has fanned out, each
sequence decoding a placeholder of its own (the step after the fork goes ahead without the
request: its new sequences do not exist until its tokens are back); seeded draws, penalties, JSON
with jump-forward and best_of ranking give the sync engine's completions too."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import numpy as np
import pytest
import torch

from asyncpaged import EngineStatistics, SamplingParams
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.worker import process as runner_process
from asyncpaged.worker.late_inputs import LateInputs, with_late_inputs
from asyncpaged.worker.protocol import LateDelivery, SequenceStep
from tests.engine.conftest import running_engine
from tests.engine.test_async_scheduling import sync_and_async
from tests.engine.test_engine import generate_all, make_prompts
from tests.engine.test_jump_forward import COMPACT
from tests.engine.test_structured_outputs import SCHEMA

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _params(i: int) -> SamplingParams:
    kind = i % 3
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=COMPACT)
    if kind == 1:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=300 + i, max_tokens=64,
                              structured_outputs=COMPACT)  # fmt: skip
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    ("backend", "jump", "config"),
    [
        ("thread", True, {}),
        ("process", True, {}),
        ("process", False, {}),
        ("thread", True, {"num_device_blocks": 14, "preemption_mode": "recompute"}),
        ("process", True, {"num_device_blocks": 14, "preemption_mode": "swap"}),
    ],
    ids=["thread", "process", "process-no-jump", "thread-recompute", "process-swap"],
)
async def test_grammar_requests_are_planned_ahead_with_the_same_tokens(
    backend: str, jump: bool, config: dict[str, Any], tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(15, seed=9)
    runs = await sync_and_async(path, prompts, _params, executor_backend=backend,
                                structured_outputs_jump_forward=jump, **config)  # fmt: skip
    tokens = {ahead: [o.outputs[0].token_ids for o in outs] for ahead, (outs, _) in runs.items()}
    assert tokens[True] == tokens[False]
    outs, stats = runs[True]
    num_valid = 0
    for i, out in enumerate(outs):
        if i % 3 != 2 and out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
            num_valid += 1
    assert num_valid >= 5, [o.outputs[0].text for o in outs]
    assert stats.num_steps_planned_ahead > stats.num_steps // 3, stats
    if config:
        assert all(s.num_preemptions > 0 for _, s in runs.values()), runs
    if jump:  # forced tokens after a token in flight: its row's sample was discarded
        assert stats.num_jump_forward_tokens > 0
        assert stats.num_discarded_rows > 0, stats
    else:
        assert stats.num_jump_forward_tokens == 0


async def test_options_that_read_the_output_come_late_with_the_same_tokens(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Bad words (greedy and seeded), min_tokens near its end and a logits processor that
    reads the output (the thread runner: processors do not cross to a process) are planned
    ahead, their options made once the step before is back; tokens equal the sync engine's.
    The processor sees exactly the output of each token it helps draw: called once per
    token, never for a row computed and discarded (its request ends on a stop token it forces, or
    on a stop string: the late options wait for the stop check)."""
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(16, seed=12)
    seen: dict[bool, list[tuple[int, ...]]] = {False: [], True: []}
    ahead = [False]

    def no_repeat(last: int) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
        """Never the last token again; ``last`` as the sixth."""

        def process(output: list[int], logits: torch.Tensor) -> torch.Tensor:
            seen[ahead[0]].append(tuple(output))
            logits = logits.clone()
            if len(output) == 5:
                logits[:] = -float("inf")
                logits[last] = 0.0
            elif output:
                logits[output[-1]] = -float("inf")
            return logits

        return process

    def params(i: int) -> SamplingParams:
        kind = i % 5
        if kind == 0:
            return SamplingParams(temperature=0.0, max_tokens=12, bad_words=["the", "a cat"])
        if kind == 1:
            return SamplingParams(temperature=0.9, seed=40 + i, max_tokens=12, min_tokens=8,
                                  bad_words=["and"])  # fmt: skip
        if kind == 2:
            return SamplingParams(temperature=0.0, max_tokens=12, min_tokens=10)
        if kind == 3:
            return SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[7],
                                  logits_processors=[no_repeat(7)])  # fmt: skip
        # 285 is " memory"
        return SamplingParams(temperature=0.0, max_tokens=12, stop=[" memory"],
                              logits_processors=[no_repeat(285)])  # fmt: skip

    runs = {}
    for on in (False, True):
        ahead[0] = on
        with anyio.fail_after(180):
            async with running_engine(path, async_scheduling=on,
                                      executor_backend="thread") as engine:  # fmt: skip
                runs[on] = (await generate_all(engine, prompts, params), engine.statistics())
    tokens = {on: [o.outputs[0].token_ids for o in outs] for on, (outs, _) in runs.items()}
    assert tokens[True] == tokens[False]
    stats = runs[True][1]
    assert stats.num_steps_planned_ahead > stats.num_steps // 2, stats
    assert stats.num_discarded_rows > 0, stats
    for on in (False, True):  # one call per token drawn, with the output before it
        outs = [o.outputs[0] for i, o in enumerate(runs[on][0]) if i % 5 >= 3]
        assert all(len(o.token_ids) <= 6 and o.finish_reason == "stop" for o in outs), outs
        assert {o.stop_reason for o in outs} == {7, " memory"}
        want = sorted(tuple(o.token_ids[:k]) for o in outs for k in range(len(o.token_ids)))
        assert sorted(seen[on]) == want


def test_late_inputs_are_taken_in_order() -> None:
    late = LateInputs()
    options = SamplingOptions(temperature=0.5, banned_token_ids=(4,))
    first = LateDelivery(rows=(3, 5), options=((3, options),), masked=(5,),
                         masks=np.arange(4, dtype=np.int32)[None])  # fmt: skip
    late.put(first)
    late.put(LateDelivery(rows=(7,)))
    got = late.take((3, 5))
    assert got.options == ((3, options),)
    masks = got.masks_by_seq()
    assert list(masks) == [5] and torch.equal(masks[5], torch.arange(4, dtype=torch.int32))
    with pytest.raises(AssertionError, match="expected"):  # a delivery for another step
        late.take((8,))


def test_late_inputs_go_into_their_rows_only() -> None:
    """Options that read the output replace the planned ones (None: plain greedy, as for a
    row computed and discarded), a bitmask goes into the row's options (greedy ones made for it),
    and rows without late inputs stay the very same objects."""

    def row(seq_id: int, sampling: SamplingOptions | None) -> SequenceStep:
        return SequenceStep(seq_id=seq_id, token_ids=(-1,), num_computed_tokens=4,
                            slot_mapping=(4,), block_table=(0,), do_sample=True,
                            sampling=sampling)  # fmt: skip

    planned = SamplingOptions(temperature=0.7)
    late = SamplingOptions(temperature=0.7, banned_token_ids=(3, 9))
    seqs = (row(1, None), row(2, planned), row(3, planned), row(4, planned), row(5, None))
    mask = np.array([[7, 0], [1, 2]], dtype=np.int32)
    delivery = LateDelivery(rows=(1, 2, 3, 4), options=((2, late), (3, None), (4, late)),
                            masked=(1, 4), masks=mask)  # fmt: skip
    got = with_late_inputs(seqs, delivery)
    assert got[0].sampling is not None and got[0].sampling.is_greedy
    assert torch.equal(got[0].sampling.token_bitmask, torch.tensor([7, 0], dtype=torch.int32))
    assert got[1].sampling is late
    assert got[2].sampling is None
    fourth = got[3].sampling
    assert fourth is not None and fourth.banned_token_ids == (3, 9) and fourth.temperature == 0.7
    assert torch.equal(fourth.token_bitmask, torch.tensor([1, 2], dtype=torch.int32))
    assert got[4] is seqs[4]


async def test_large_deliveries_go_down_the_pipe_from_a_thread(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Past a tiny ``PIPELINE_BYTES`` every late delivery is written from a worker thread (the
    process takes it only after the step's forward; the loop runs meanwhile) and the step
    sent after it waits for that write: the same tokens as the sync engine."""
    monkeypatch.setattr(runner_process, "PIPELINE_BYTES", 64)
    threads: set[bool] = set()
    write = runner_process.RunnerProcess._write

    def spy(self: runner_process.RunnerProcess, data: bytes) -> None:
        threads.add(threading.current_thread() is threading.main_thread())
        write(self, data)

    monkeypatch.setattr(runner_process.RunnerProcess, "_write", spy)
    prompts = make_prompts(9, seed=14)
    runs = await sync_and_async(tiny_checkpoint(MODEL), prompts, _params,
                                executor_backend="process")  # fmt: skip
    tokens = {on: [o.outputs[0].token_ids for o in outs] for on, (outs, _) in runs.items()}
    assert tokens[True] == tokens[False]
    assert runs[True][1].num_steps_planned_ahead > 0
    assert threads == {True, False}  # requests from the loop, deliveries from a thread


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_a_failure_before_the_delivery_reaches_every_waiter(
    backend: str, monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """The scheduler fails while a step planned ahead waits in the runner for its late inputs:
    the engine closes without hanging (the thread's wait is woken, the process is stopped)
    and every request's waiter gets the engine's death."""
    from asyncpaged import AsyncEngine, EngineConfig, EngineDeadError
    from asyncpaged.actors.step_builder import StepBuilder

    def broken(*args: object, **kwargs: object) -> LateDelivery:
        raise RuntimeError("injected: no late inputs")

    monkeypatch.setattr(StepBuilder, "late_inputs", broken)
    config = EngineConfig(model=str(tiny_checkpoint(MODEL)), dtype="float32",
                          executor_backend=backend, async_scheduling=True)  # fmt: skip
    errors: list[BaseException] = []
    with anyio.fail_after(60), pytest.raises(EngineDeadError):
        async with AsyncEngine(config) as engine:

            async def one(i: int) -> None:
                try:
                    await engine.generate(list(make_prompts(4, seed=2)[i]), _params(0))
                except EngineDeadError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
    assert len(errors) == 4
    assert all("injected" in str(e.__cause__) for e in errors), errors


def _parallel_params(i: int) -> SamplingParams:
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.8, top_p=0.9, n=3, seed=500 + i, max_tokens=14,
                              ignore_eos=True)  # fmt: skip
    if kind == 1:
        return SamplingParams(temperature=0.7, n=2, best_of=3, seed=600 + i, max_tokens=10,
                              repetition_penalty=1.2, frequency_penalty=0.3)  # fmt: skip
    if kind == 2:
        return SamplingParams(temperature=0.9, n=2, seed=700 + i, max_tokens=48,
                              structured_outputs=COMPACT)  # fmt: skip
    return SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.mark.parametrize(
    ("backend", "config"),
    [
        ("thread", {}),
        ("process", {}),
        ("thread", {"num_device_blocks": 20, "preemption_mode": "recompute"}),
        ("process", {"num_device_blocks": 20, "preemption_mode": "swap"}),
    ],
    ids=["thread", "process", "thread-recompute", "process-swap"],
)
async def test_parallel_sampling_is_planned_ahead_with_the_same_completions(
    backend: str, config: dict[str, Any], tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(12, seed=21)
    runs = await sync_and_async(path, prompts, _parallel_params, executor_backend=backend, **config)
    completions = {
        ahead: [[(c.index, c.token_ids) for c in o.outputs] for o in outs]
        for ahead, (outs, _) in runs.items()
    }
    assert completions[True] == completions[False]
    stats = runs[True][1]
    assert stats.num_jump_forward_tokens > 0
    if config:  # (nothing is planned ahead while anything is swapped)
        assert all(s.num_preemptions > 0 for _, s in runs.values()), runs
        assert stats.num_steps_planned_ahead > 0, stats
    else:
        assert stats.num_steps_planned_ahead > stats.num_steps // 2, stats


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_a_fan_out_in_flight_sits_the_next_step_out(
    backend: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """n = 2 requests arriving one by one while a long request decodes: the step after each
    fork goes ahead without that request (its sequences exist once the fork is back,
    and the step after forks them), so only the first step waits (before, one per fork);
    every completion is the sync engine's."""
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(7, seed=22)

    def params(i: int) -> SamplingParams:
        if i == 0:
            return SamplingParams(temperature=0.8, seed=1, max_tokens=160, ignore_eos=True)
        return SamplingParams(temperature=0.9, n=2, seed=10 + i, max_tokens=6, ignore_eos=True)

    async def run(ahead: bool) -> tuple[dict[int, list[list[int]]], EngineStatistics]:
        outs: dict[int, list[list[int]]] = {}
        async with running_engine(path, async_scheduling=ahead,
                                  executor_backend=backend) as engine:  # fmt: skip

            async def one(i: int) -> None:
                out = await engine.generate(list(prompts[i]), params(i))
                outs[i] = [list(c.token_ids) for c in out.outputs]

            async with anyio.create_task_group() as tg:
                started = 1
                async for out in engine.generate(list(prompts[0]), params(0)):
                    if started < len(prompts) and len(out.outputs[0].token_ids) >= 16 * started:
                        tg.start_soon(one, started)  # every 16 tokens of the long one
                        started += 1
                outs[0] = [list(out.outputs[0].token_ids)]
            return outs, engine.statistics()

    with anyio.fail_after(120):
        results = {ahead: await run(ahead) for ahead in (False, True)}
    assert results[True][0] == results[False][0]
    stats = results[True][1]
    assert stats.num_steps - stats.num_steps_planned_ahead <= 2, stats
