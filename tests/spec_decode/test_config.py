"""SpeculativeConfig: vLLM's field names, defaults and refusals."""

from __future__ import annotations

import pytest

from asyncpaged import EngineConfig, InvalidRequestError, SpeculativeConfig


def test_ngram_defaults_follow_vllm() -> None:
    both = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    given = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4
    )
    assert (given.prompt_lookup_min, given.prompt_lookup_max) == (1, 4)


def test_draft_model_needs_a_model_and_no_lookup_sizes() -> None:
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, model="/ckpt/d")
    assert config.model == "/ckpt/d"
    assert config.prompt_lookup_min is None
    with pytest.raises(InvalidRequestError, match="needs model"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=4)
    with pytest.raises(InvalidRequestError, match="'ngram' method only"):
        SpeculativeConfig(
            method="draft_model", num_speculative_tokens=4, model="d", prompt_lookup_max=3
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "must be 'ngram' or 'draft_model'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
        ({"method": "ngram", "num_speculative_tokens": True}, "at least 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "d"}, "model must be None"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "at least 1"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 3},
            "at most prompt_lookup_max",
        ),
    ],
)  # fmt: skip
def test_invalid_settings_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


def test_engine_config_carries_it() -> None:
    assert EngineConfig(model="m").speculative_config is None
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    config = EngineConfig(model="m", speculative_config=spec)
    assert config.speculative_config == spec
    with pytest.raises(AttributeError):
        spec.num_speculative_tokens = 3  # type: ignore[misc]
