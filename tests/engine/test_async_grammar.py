"""Async scheduling with structured outputs: a grammar request's decode is planned ahead of the
step that samples its input token; its bitmask is made once that step is back and reaches the
runner while the forward runs (``late_masks``); a grammar that forces tokens after that input
(jump-forward) voids the sample planned ahead, and the next plan computes the forced tokens.

The oracle is the engine without async scheduling: greedy and seeded sampled JSON requests,
beside plain ones, draw exactly its tokens with the runner on the thread and in its process,
jump-forward on and off, under preemption, and every JSON object that ends validates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from asyncpaged import SamplingParams, StructuredOutputsParams
from asyncpaged.model.late_masks import LateMasks, MaskDelivery
from tests.engine.test_async_scheduling import sync_and_async
from tests.engine.test_engine import make_prompts
from tests.engine.test_structured_outputs import SCHEMA

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"
COMPACT = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


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
    if jump:  # forced tokens after a token in flight: its row's sample was void
        assert stats.num_jump_forward_tokens > 0
        assert stats.num_rows_in_vain > 0, stats
    else:
        assert stats.num_jump_forward_tokens == 0


def test_late_masks_are_taken_in_order_and_close_wakes_a_waiter() -> None:
    masks = LateMasks()
    first = MaskDelivery(rows=(3, 5), masked=(5,), masks=np.arange(4, dtype=np.int32)[None])
    masks.put(first)
    masks.put(MaskDelivery(rows=(7,), masked=(), masks=np.zeros((0, 0), np.int32)))
    got = masks.take((3, 5))
    assert list(got) == [5] and torch.equal(got[5], torch.arange(4, dtype=torch.int32))
    with pytest.raises(AssertionError, match="expected"):  # a delivery for another step
        masks.take((8,))
    masks.close()
    for _ in range(2):  # every take after close raises, the waiting one and later ones
        with pytest.raises(RuntimeError, match="stopped"):
            masks.take((9,))
