"""Async scheduling with parallel sampling (n > 1, best_of): once a request has fanned out, the
decodes of all its sequences are planned ahead of the step that samples their tokens, each a
late token of its own; the fan-out step itself is not planned ahead of (its new sequences do
not exist until its tokens are back). Seeded draws, penalties, a grammar with jump-forward
(a void sample in one sequence makes its family wait for the step in flight) and best_of
ranking give the sync engine's completions, under swap and recompute preemption, with the
runner on the thread and in its process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncpaged import SamplingParams
from tests.engine.test_async_scheduling import sync_and_async
from tests.engine.test_engine import make_prompts
from tests.engine.test_jump_forward import COMPACT

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _params(i: int) -> SamplingParams:
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
    runs = await sync_and_async(path, prompts, _params, executor_backend=backend, **config)
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
