"""The runner samples top-k rows through the screened head: the same tokens as the full head."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from asyncpaged.model import lm_head
from asyncpaged.sampling.options import SamplingOptions
from tests.model.driver import Driver
from tests.model.test_generate_equality import _make_sequences, _runner


@pytest.mark.parametrize("name", ["llama-gqa", "opt", "gpt2"])
def test_screened_top_k_equals_the_full_head(
    name: str, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = lm_head.ScreenedLMHead.topk_candidates

    def spy(self, hidden, top_k):  # type: ignore[no-untyped-def]
        calls.append(hidden.shape[0])
        return original(self, hidden, top_k)

    monkeypatch.setattr(lm_head.ScreenedLMHead, "topk_candidates", spy)
    outputs = []
    for screened in (True, False):
        seqs = _make_sequences(seed=4)
        for i, seq in enumerate(seqs):
            seq.sampling = SamplingOptions(
                temperature=[0.0, 0.7, 1.3][i % 3],
                top_k=[1, 5, 40, 64][i % 4],
                top_p=[1.0, 0.9][i % 2],
                seed=i if i % 3 == 0 else None,
            )
        runner = _runner(tiny_checkpoint(name), screened_lm_head=screened)
        Driver(runner, seed=5, want_logprob=False).run(seqs)
        outputs.append([s.output for s in seqs])
    assert calls, "the screened top-k path was never taken"
    assert outputs[0] == outputs[1]
