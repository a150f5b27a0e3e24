"""SamplingParams / BeamSearchParams: vLLM's defaults, every validation message, normalization."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from asyncpaged.errors import AsyncPagedError, InvalidRequestError
from asyncpaged.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
)
from asyncpaged.structured_outputs import StructuredOutputsParams

# vLLM's SamplingParams defaults, written out by hand from vllm/sampling_params.py.
VLLM_DEFAULTS = {
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": (),  # vLLM: None normalized to []
    "stop_token_ids": (),  # vLLM: None normalized to []
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "output_kind": RequestOutputKind.CUMULATIVE,
    # vLLM's None, stored normalized: no bias pairs, every token allowed, no bad words
    "logit_bias": (),
    "allowed_token_ids": None,
    "bad_words": (),
    "structured_outputs": None,
    "detokenize": True,
    "truncate_prompt_tokens": None,
    "logits_processors": (),
    "thinking_token_budget": None,
}


def test_defaults_equal_vllm() -> None:
    params = SamplingParams()
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    assert values == VLLM_DEFAULTS
    assert params.explicit_fields == frozenset()


def test_request_output_kind_values_equal_vllm() -> None:
    assert [(k.name, int(k)) for k in RequestOutputKind] == [
        ("CUMULATIVE", 0),
        ("DELTA", 1),
        ("FINAL_ONLY", 2),
    ]
    assert [(k.name, int(k)) for k in SamplingType] == [
        ("GREEDY", 0),
        ("RANDOM", 1),
        ("RANDOM_SEED", 2),
    ]


def test_frozen_and_hashable() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    assert params == SamplingParams(stop=("a", "b"), stop_token_ids=(3,))
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3,)))
    assert params != SamplingParams(stop=["b", "a"], stop_token_ids=[3])


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


def _msg(text: str) -> str:
    return "^" + re.escape(text) + "$"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"n": True}, "n must be an int, got bool."),
        ({"n": 1.0}, "n must be an int, got float."),
        (
            {"n": 3, "best_of": 2},
            "best_of must be greater than or equal to n, got n=3 and best_of=2.",
        ),
        ({"best_of": 0}, "best_of must be greater than or equal to n, got n=1 and best_of=0."),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5."),
        ({"presence_penalty": -2.01}, "presence_penalty must be in [-2, 2], got -2.01."),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0."),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0."),
        ({"repetition_penalty": -1}, "repetition_penalty must be greater than zero, got -1.0."),
        ({"temperature": -1.0}, "temperature must be non-negative, got -1.0."),
        ({"temperature": "hot"}, "temperature must be a number, got str."),
        ({"temperature": True}, "temperature must be a number, got bool."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_k": -3}, "top_k must be 0 (disable), or at least 1, got -3."),
        ({"top_k": 2.0}, "top_k must be an int, got float."),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"seed": 2**64}, f"seed must be in [-2**63, 2**64 - 1], got {2**64}."),
        ({"seed": "1"}, "seed must be an int, got str."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"max_tokens": -5}, "max_tokens must be at least 1, got -5."),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"min_tokens": 17},
            "min_tokens must be less than or equal to max_tokens=16, got 17.",
        ),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1."),
        ({"logprobs": 1.5}, "logprobs must be an int, got float."),
        (
            {"prompt_logprobs": -1},
            "prompt_logprobs must be non-negative, got -1 (-1, the whole "
            "vocabulary, is not supported).",
        ),
        ({"prompt_logprobs": True}, "prompt_logprobs must be an int, got bool."),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string."),
        ({"stop": ""}, "stop cannot contain an empty string."),
        ({"stop": ["ok", 3]}, "stop must be a string or a list of strings, got ['ok', 3]."),
        (
            {"stop_token_ids": [1, -2]},
            "stop_token_ids must contain only non-negative integers, got [1, -2].",
        ),
        (
            {"stop_token_ids": [1, "2"]},
            "stop_token_ids must contain only non-negative integers, got [1, '2'].",
        ),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got int."),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got NoneType."),
        ({"output_kind": 7}, "output_kind must be a RequestOutputKind, got 7."),
        (
            {"n": 2, "best_of": 3, "output_kind": RequestOutputKind.DELTA},
            "best_of must equal n to use output_kind=DELTA",
        ),
        (
            {"temperature": 0.0, "n": 2, "best_of": 3},
            "best_of must equal n when using greedy sampling, got n=2 and best_of=3.",
        ),
        ({"thinking_token_budget": -1}, "thinking_token_budget must be non-negative, got -1."),
        ({"thinking_token_budget": 2.0}, "thinking_token_budget must be an int, got float."),
        ({"thinking_token_budget": True}, "thinking_token_budget must be an int, got bool."),
        (
            {"thinking_token_budget": 4, "logprobs": 0},
            "thinking_token_budget cannot be combined with logprobs: the end marker it forces "
            "is appended unsampled (no logprob, not checked by a grammar).",
        ),
        (
            {"thinking_token_budget": 4, "n": 1, "best_of": 2},
            "thinking_token_budget cannot be combined with best_of > n: the end marker it forces "
            "is appended unsampled (no logprob, not checked by a grammar).",
        ),
        (
            {"thinking_token_budget": 0, "structured_outputs": StructuredOutputsParams(regex="a")},
            "thinking_token_budget cannot be combined with structured_outputs: the end marker "
            "it forces is appended unsampled (no logprob, not checked by a grammar).",
        ),
    ],
)
def test_invalid_values_are_refused_with_vllm_like_messages(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=_msg(message)):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "min_p",
    ],
)
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        pytest.param(10**400, "an int too large for a float", id="huge-int"),
    ],
)
def test_non_finite_floats_are_refused(name: str, value: float, shown: str) -> None:
    with pytest.raises(
        InvalidRequestError, match=_msg(f"{name} must be a finite number, got {shown}.")
    ):
        SamplingParams(**{name: value})  # type: ignore[arg-type]


def test_invalid_request_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=2.0)
    with pytest.raises(AsyncPagedError):
        SamplingParams(top_p=2.0)


def test_boundaries_are_accepted() -> None:
    params = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-9,
        top_p=1e-9,
        top_k=1,
        min_p=1,
        max_tokens=1,
        min_tokens=1,
        logprobs=0,
        seed=2**64 - 1,
    )
    assert params.presence_penalty == -2.0
    assert isinstance(params.presence_penalty, float)
    assert params.min_p == 1.0
    assert params.seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(n=2, best_of=2, output_kind=RequestOutputKind.DELTA).best_of == 2


def test_max_tokens_none_allows_any_min_tokens() -> None:
    params = SamplingParams(max_tokens=None, min_tokens=1000)
    assert params.max_tokens is None
    assert params.min_tokens == 1000


def test_stop_normalization() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "bc", "a"]).stop == ("a", "bc", "a")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[5, 2, 5, 7, 2]).stop_token_ids == (5, 2, 7)
    assert SamplingParams(stop_token_ids=iter([3])).stop_token_ids == (3,)


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_seed_minus_one_means_none() -> None:
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2


@pytest.mark.parametrize("temperature", [0.0, 0, 9.9e-6])
def test_greedy_resets_truncation(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=7, min_p=0.3)
    assert params.is_greedy
    assert params.sampling_type is SamplingType.GREEDY
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)


def test_random_keeps_truncation() -> None:
    params = SamplingParams(temperature=1e-5, top_p=0.5, top_k=7, min_p=0.3)
    assert not params.is_greedy
    assert params.sampling_type is SamplingType.RANDOM
    assert (params.top_p, params.top_k, params.min_p) == (0.5, 7, 0.3)
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED


def test_greedy_validates_truncation_before_resetting() -> None:
    with pytest.raises(InvalidRequestError, match="top_p must be in"):
        SamplingParams(temperature=0.0, top_p=5.0)


def test_num_sequences() -> None:
    assert SamplingParams(n=3).num_sequences == 3
    assert SamplingParams(n=2, best_of=5).num_sequences == 5


def test_output_text_buffer_length() -> None:
    assert SamplingParams().output_text_buffer_length == 0
    assert SamplingParams(stop=["a", "abcd", "xy"]).output_text_buffer_length == 3
    assert SamplingParams(stop="a").output_text_buffer_length == 0
    included = SamplingParams(stop=["abcd"], include_stop_str_in_output=True)
    assert included.output_text_buffer_length == 0


def test_replace_revalidates() -> None:
    params = SamplingParams(n=2, temperature=0.7, stop="x")
    changed = dataclasses.replace(params, top_p=0.9)
    assert changed.top_p == 0.9
    assert changed.stop == ("x",)
    assert changed.n == 2
    with pytest.raises(InvalidRequestError, match="best_of must equal n when using greedy"):
        dataclasses.replace(params, temperature=0.0, best_of=3)
    assert dataclasses.replace(params, temperature=0.0).n == 2  # n identical greedy samples


def test_beam_search_params() -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=32)
    assert (params.ignore_eos, params.temperature, params.length_penalty) == (False, 0.0, 1.0)
    assert params.include_stop_str_in_output is False
    assert BeamSearchParams(beam_width=1, max_tokens=1, length_penalty=2).length_penalty == 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.beam_width = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width must be at least 1, got 0."),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"beam_width": 2.0, "max_tokens": 4}, "beam_width must be an int, got float."),
        (
            {"beam_width": 2, "max_tokens": 4, "temperature": -0.5},
            "temperature must be non-negative, got -0.5.",
        ),
        (
            {"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan},
            "length_penalty must be a finite number, got nan.",
        ),
        (
            {"beam_width": 2, "max_tokens": 4, "ignore_eos": "no"},
            "ignore_eos must be a bool, got str.",
        ),
    ],
)
def test_beam_search_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=_msg(message)):
        BeamSearchParams(**kwargs)  # type: ignore[arg-type]
