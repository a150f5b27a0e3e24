"""The shared check of quantized checkpoints through the engine: five concurrent greedy
requests on few blocks (so they preempt each other) give transformers' float32 tokens, with
logprobs within 1e-3 of its per-step log-probabilities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import torch

from asyncpaged import SamplingParams
from tests.engine.conftest import running_engine

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52,
           53, 54, 55, 56, 57], [100, 7], [3, 30, 60, 90, 120]]  # fmt: skip
MAX_TOKENS = 10


def transformers_reference(model: Any) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """transformers' greedy tokens and per-step log-probabilities for every prompt."""
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logprobs.append([torch.log_softmax(s[0].double(), -1) for s in out.logits])
    return tokens, logprobs


async def assert_engine_equals(path: Path, reference: Any, **config: Any) -> Any:
    """Run ``PROMPTS`` through the engine on ``path`` with preemption and compare them with
    ``transformers_reference(reference)``; returns the engine's loaded model. ``config``: more
    ``EngineConfig`` fields (``device="cuda"``)."""
    want, want_logprobs = transformers_reference(reference)
    async with running_engine(path, num_device_blocks=9, block_size=4,
                              executor_backend="thread", **config) as engine:  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=1)  # fmt: skip
        outs: list[Any] = [None] * len(PROMPTS)

        async def one(i: int) -> None:
            outs[i] = await engine.generate(PROMPTS[i], params)

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        assert engine.statistics().num_preemptions > 0
        model = engine.runner.model if engine.runner is not None else None
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        assert completion.token_ids == want[i], (i, completion.token_ids, want[i])
        for step, token in enumerate(completion.token_ids):
            got = completion.logprobs[step][token].logprob
            assert abs(got - float(want_logprobs[i][step][token])) < 1e-3
    assert model is not None
    return model
