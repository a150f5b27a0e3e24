"""What ``generate`` refuses before any work, as pure functions (no engine)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from asyncpaged import InvalidRequestError, SamplingParams
from asyncpaged.inputs import parse_prompt
from asyncpaged.request_checks import (
    check_cache_salt,
    check_group_width,
    check_request_id,
    check_text_prompt,
    max_prompt_chars,
)


@pytest.mark.parametrize(
    "prompt", [None, 5, 1.5, b"abc", bytearray(b"ab"), {5: 1}, {"prompt": 5}, [True, False],
               [1, 2.0], np.array([True]), np.array([1.5]), torch.tensor([[1, 2]]),
               [np.bool_(True)]],
)  # fmt: skip
def test_parse_prompt_refuses_loose_forms(prompt: object) -> None:
    with pytest.raises(InvalidRequestError):
        parse_prompt(prompt)


def test_parse_prompt_takes_integer_arrays_and_scalars() -> None:
    for ids in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), torch.tensor(6), 7],
                np.array([5, 6, 7], dtype=np.uint16)):  # fmt: skip
        parsed = parse_prompt(ids)
        assert parsed.token_ids == (5, 6, 7) and all(type(t) is int for t in parsed.token_ids)


def test_parse_prompt_checks_the_length_first() -> None:
    class Huge(list[int]):
        def __iter__(self) -> Iterator[int]:
            raise AssertionError("iterated before the length check")

    with pytest.raises(InvalidRequestError, match="shorter than max_model_len"):
        parse_prompt(Huge([1] * 100), max_num_tokens=64)


@pytest.mark.parametrize(
    "kwargs",
    [{"stop": 123}, {"stop": [1]}, {"stop_token_ids": 5}, {"stop_token_ids": "ab"},
     {"allowed_token_ids": 5}, {"bad_words": 5}, {"logits_processors": 5},
     {"stop": ["a\ud800"]}, {"bad_words": ["\ud800x"]}],
)  # fmt: skip
def test_sampling_params_refuse_wrong_types_with_a_clear_message(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError, match=next(iter(kwargs)).split("_")[0]):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_ids_and_salts() -> None:
    assert check_request_id("r1") == "r1"
    for bad in (["x"], 5, b"r", "a\ud800"):
        with pytest.raises(InvalidRequestError, match="request_id"):
            check_request_id(bad)
    assert check_cache_salt(None) is None and check_cache_salt("tenant") == "tenant"
    for salt in (3, b"x", "a\x00b", "a\ud800"):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            check_cache_salt(salt)


def test_text_prompt_bound_and_unicode() -> None:
    class Tok:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "abcd": 1}

    limit = max_prompt_chars(Tok(), 10)
    assert limit == 40
    check_text_prompt("x" * 40, limit, 10)
    with pytest.raises(InvalidRequestError, match="41 characters"):
        check_text_prompt("x" * 41, limit, 10)
    with pytest.raises(InvalidRequestError, match="surrogate"):
        check_text_prompt("ab\ud800cd", limit, 10)
    with pytest.raises(InvalidRequestError, match="empty"):
        check_text_prompt("", limit, 10)


def test_group_width() -> None:
    check_group_width(4, "n", max_num_seqs=4, max_num_batched_tokens=2048)
    with pytest.raises(InvalidRequestError, match="max_num_seqs=4"):
        check_group_width(5, "n", max_num_seqs=4, max_num_batched_tokens=2048)
    with pytest.raises(InvalidRequestError, match="beam_width=9"):
        check_group_width(9, "beam_width", max_num_seqs=256, max_num_batched_tokens=8)
