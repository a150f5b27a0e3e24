"""Penalized requests through the engine: greedy with a repetition penalty equals transformers'
``generate(repetition_penalty=...)``, token for token, with requests batched and decoding for
many steps (the prompt is kept as one tuple per request; the runner keeps each row's history
between steps and each step sends only its new tokens, ``worker/input_batch.py``), and
under memory pressure, where preempted sequences come back and resend their whole history."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import EngineStatistics, RequestOutput, SamplingParams
from tests.engine.conftest import running_engine
from tests.engine.test_engine import generate_all, make_prompts
from tests.engine.test_persistent_tables import Recorder

MODEL = "llama-gqa"
NEW_TOKENS = 24
PENALTY = 1.8

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _transformers(path: Path, prompt: tuple[int, ...]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
            min_new_tokens=0, eos_token_id=None, pad_token_id=0, repetition_penalty=PENALTY,
        )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                        repetition_penalty=PENALTY)  # fmt: skip


async def _run(
    path: Path, prompts: list[tuple[int, ...]], **config: Any
) -> tuple[list[RequestOutput], Recorder, EngineStatistics, list[RequestOutput]]:
    """The penalized requests (then the first one without a penalty), every plan recorded."""
    with anyio.fail_after(120):
        async with running_engine(path, **config) as engine:
            recorder = Recorder(engine._executor.runner)
            engine._executor.runner = recorder
            outs = await generate_all(engine, prompts, PARAMS)
            stats = engine.statistics()
            plain = await generate_all(engine, prompts[:1], SamplingParams(
                temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))  # fmt: skip
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _transformers(path, prompt), prompt
    return outs, recorder, stats, plain


async def test_greedy_repetition_penalty_matches_transformers(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    prompts = make_prompts(5, seed=11)
    outs, recorder, _, plain = await _run(tiny_checkpoint(MODEL), prompts, num_device_blocks=64)
    # The penalty did something: the first prompt's tokens differ without it.
    assert plain[0].outputs[0].token_ids != outs[0].outputs[0].token_ids
    # Each row sent only the token since the last step: every output token (but the last,
    # which no step reads) travelled once; each request's options travelled once (then the
    # runner kept them: ``keep_sampling``).
    penalized = [s for p in recorder.plans for s in p.seqs if s.history is not None]
    assert len(penalized) == len(prompts) * NEW_TOKENS  # every draw of the penalized requests
    rows = [s.sampling for s in penalized if s.sampling is not None]
    assert all(o.history_seq is not None and o.output_token_ids == () for o in rows)
    assert len(rows) == len(prompts)
    assert all(s.keep_sampling for s in penalized if s.sampling is None)
    tails = [s.history[1] for s in penalized if s.history is not None]
    assert all(len(t) <= 1 for t in tails)
    assert sum(len(t) for t in tails) == len(prompts) * (NEW_TOKENS - 1)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_penalized_requests_under_memory_pressure_match_transformers(
    mode: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    prompts = make_prompts(12, seed=5)
    _, recorder, stats, _ = await _run(tiny_checkpoint(MODEL), prompts, num_device_blocks=10,
                                       preemption_mode=mode)  # fmt: skip
    assert stats.num_preemptions > 0
    # Preempted sequences came back and sent their whole output again.
    rows = [s.history for p in recorder.plans for s in p.seqs if s.history is not None]
    resent = [h for h in rows if h[0] == 0 and len(h[1]) > 1]
    assert resent, "no sequence resent its history after a preemption"
