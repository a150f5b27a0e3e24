"""The server on a tiny checkpoint of another family: greedy batch completions from token-id
prompts equal transformers', and the model's own max_model_len bounds the prompts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.server import create_app
from tests.model.conftest import tiny_checkpoint
from tests.model.reference import HFReference
from tests.server.conftest import Live, live_app

__all__ = ["tiny_checkpoint"]
MODEL = "qwen3"


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint: Callable[[str], Path]) -> Iterator[tuple[Live, Path]]:
    path = tiny_checkpoint(MODEL)
    config = EngineConfig(model=str(path), dtype="float32", max_model_len=64,
                          num_device_blocks=32)  # fmt: skip

    def make(engine: AsyncEngine | None) -> object:
        assert engine is not None
        return create_app(engine, served_model_name=MODEL)

    with live_app(make, config) as live:  # type: ignore[arg-type]
        yield live, path


def test_batch_of_token_prompts_equals_transformers(qwen3: tuple[Live, Path]) -> None:
    live, path = qwen3
    prompts = [[5, 9, 14, 3, 27, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53,
                                      54, 55, 56, 57]]  # fmt: skip
    reference = HFReference(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    out = live.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(prompts, out.choices, strict=True):
        want, want_logprobs = reference.generate(tuple(prompt), 8)
        assert choice.logprobs is not None
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want]
        assert choice.logprobs.token_logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert out.usage is not None and out.usage.prompt_tokens == 6 + 18


def test_the_models_context_bounds_the_prompt(qwen3: tuple[Live, Path]) -> None:
    client = qwen3[0].client()
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=list(range(5, 69)), max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="exceeds max_model_len"):
        client.completions.create(model=MODEL, prompt=list(range(5, 55)), max_tokens=20,
                                  stream=True)  # fmt: skip
    ok = client.completions.create(model=MODEL, prompt=list(range(5, 55)), max_tokens=4)
    assert ok.usage is not None and ok.usage.completion_tokens <= 4
