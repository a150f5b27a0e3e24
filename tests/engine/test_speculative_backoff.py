"""When speculation stops paying: back-off after wasted rounds, and ``disable_by_batch_size``.

A proposer that is always wrong must cost few verification rounds (each round that keeps no
proposal doubles the pause before the next, up to 16 steps); with ``disable_by_batch_size``
nothing is proposed while more sequences run. Outputs stay exact either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpaged import AsyncEngine, SamplingParams, SpeculativeConfig
from tests.engine.conftest import running_engine
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Wrong:
    """Proposes k tokens no model picks (the id after the last token's, shifted far)."""

    def __init__(self) -> None:
        self.calls = 0
        self.running_seen: list[int] = []
        self.engine: AsyncEngine | None = None

    def __call__(self, *args: Any) -> Sequence[int]:
        token_ids, k = args[-2], args[-1]  # (token_ids, k), or (seq_id, token_ids, k)
        self.calls += 1
        if self.engine is not None:
            self.running_seen.append(self.engine.statistics().num_running)
        return [4 + (token_ids[-1] + 97 + j) % 300 for j in range(k)]


async def test_wasted_rounds_back_off_and_stay_exact(
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    wrong = Wrong()
    monkeypatch.setattr(AsyncEngine, "_proposer", lambda self: wrong)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    prompt = (5, 9, 14, 20, 27, 35, 44)
    with anyio.fail_after(60):
        async with running_engine(path, speculative_config=spec) as engine:
            out = await engine.generate(
                list(prompt), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            )
            stats = engine.statistics()
    assert out.outputs[0].token_ids == ref.generate(prompt, 40)[0]
    # 39 decode steps; proposing at steps 1, 3, 6, 11, 20, 37 (pauses 1, 2, 4, 8, 16) or so
    assert 4 <= wrong.calls <= 8, wrong.calls
    assert stats.num_accepted_tokens < stats.num_draft_tokens


async def test_no_proposals_above_the_batch_size_limit(
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    wrong = Wrong()
    monkeypatch.setattr(AsyncEngine, "_proposer", lambda self: wrong)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, disable_by_batch_size=2)
    prompts = [tuple(range(10 + i, 22 + i)) for i in range(4)]
    lengths = [4, 4, 30, 30]  # two finish early, then two run: proposals start
    with anyio.fail_after(60):
        async with running_engine(path, speculative_config=spec) as engine:
            wrong.engine = engine
            outs: list[Any] = [None] * 4

            async def one(i: int) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
                outs[i] = await engine.generate(list(prompts[i]), params)

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, n)[0]
    assert wrong.calls > 0, "two sequences ran at the end: proposals were due"
    assert max(wrong.running_seen) <= 2, wrong.running_seen
