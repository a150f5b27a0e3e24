"""Construction helpers for ``sampling_params.py``: the field checks and the model-default markers.

The ``check_*``, ``normalize_*`` and ``verify_*`` helpers take the values given for a field
(or a few related ones) and return what :class:`~asyncpaged.sampling_params.SamplingParams` or
:class:`~asyncpaged.sampling_params.BeamSearchParams` stores (numbers as ``float``, sequences as
normalized tuples), or raise :class:`~asyncpaged.errors.InvalidRequestError` naming the first bad
field. ``MODEL_DEFAULTS`` holds the defaults a model's generation config may override, as
``DefaultFloat``/``DefaultInt`` objects, so that ``SamplingParams`` can tell a default left
unset from the same value given. Only ``sampling_params.py`` uses this module; ``_verify_counts``
stays there, next to the ``RequestOutputKind`` it checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from asyncpaged.errors import InvalidRequestError


class DefaultFloat(float):
    """A default that knows it is one: ``value is MODEL_DEFAULTS[name]`` means "the caller
    left it"."""


class DefaultInt(int):
    """See :class:`DefaultFloat`."""


#: Defaults a model's ``generation_config.json`` may override (vLLM's
#: ``get_default_sampling_params``), as objects told apart from the same values given by a caller.
MODEL_DEFAULTS: dict[str, object] = {
    "temperature": DefaultFloat(1.0),
    "top_p": DefaultFloat(1.0),
    "top_k": DefaultInt(0),
    "min_p": DefaultFloat(0.0),
    "repetition_penalty": DefaultFloat(1.0),
    "max_tokens": DefaultInt(16),
}


def check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an int, got {type(value).__name__}.")
    return value


def check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__}.")
    try:
        as_float = float(value)
    except OverflowError:
        raise InvalidRequestError(
            f"{name} must be a finite number, got an int too large for a float."
        ) from None
    if not math.isfinite(as_float):
        raise InvalidRequestError(f"{name} must be a finite number, got {value}.")
    return as_float


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a bool, got {type(value).__name__}.")
    return value


def as_tuple(name: str, value: object, what: str) -> tuple[Any, ...]:
    """``tuple(value)`` for a list, tuple, set or other iterable (not a str, bytes or dict);
    InvalidRequestError naming the field otherwise."""
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"{name} must be {what}, got {type(value).__name__}.")
    return tuple(value)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: tokenizers raise on it
        return False
    return True


def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    what = "a string or a list of strings"
    stop_strs = (stop,) if isinstance(stop, str) else as_tuple("stop", stop, what)
    if not all(isinstance(s, str) for s in stop_strs):
        raise InvalidRequestError(f"stop must be {what}, got {stop!r:.80}.")
    if any(not s for s in stop_strs):
        raise InvalidRequestError("stop cannot contain an empty string.")
    if not all(_is_unicode(s) for s in stop_strs):
        raise InvalidRequestError("stop strings must be valid Unicode (a lone surrogate?).")
    return stop_strs


def normalize_stop_token_ids(stop_token_ids: Iterable[int] | None) -> tuple[int, ...]:
    if stop_token_ids is None:
        return ()
    ids = as_tuple("stop_token_ids", stop_token_ids, "a list of token ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InvalidRequestError(
            f"stop_token_ids must contain only non-negative integers, got {list(ids)[:8]}."
        )
    return tuple(dict.fromkeys(ids))


def normalize_logit_bias(logit_bias: object) -> tuple[tuple[int, float], ...]:
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, Mapping):
        raise InvalidRequestError(
            f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}."
        )
    pairs = []
    for token, bias in logit_bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (ints >= 0), got {token!r}."
            )
        pairs.append((token, check_float(f"logit_bias[{token}]", bias)))
    return tuple(sorted(pairs))


def normalize_allowed(allowed: Iterable[int] | None) -> tuple[int, ...] | None:
    if allowed is None:
        return None
    ids = as_tuple("allowed_token_ids", allowed, "a list of token ids")
    if not ids:
        raise InvalidRequestError("allowed_token_ids must not be empty (None allows every token).")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InvalidRequestError(
            f"allowed_token_ids must contain only non-negative integers, got {list(ids)[:8]}."
        )
    return tuple(dict.fromkeys(ids))


def normalize_bad_words(bad_words: str | Sequence[str] | None) -> tuple[str, ...]:
    if bad_words is None:
        return ()
    what = "a string or a list of strings"
    words = (bad_words,) if isinstance(bad_words, str) else as_tuple("bad_words", bad_words, what)
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise InvalidRequestError(f"bad_words must be non-empty strings, got {bad_words!r:.80}.")
    if not all(_is_unicode(w) for w in words):
        raise InvalidRequestError("bad_words must be valid Unicode (a lone surrogate?).")
    return words


BOOL_FIELDS = frozenset(
    {
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "detokenize",
    }
)


def verify_penalties(
    presence_penalty: float, frequency_penalty: float, repetition_penalty: float
) -> tuple[float, float, float]:
    presence_penalty = check_float("presence_penalty", presence_penalty)
    if not -2.0 <= presence_penalty <= 2.0:
        raise InvalidRequestError(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
    frequency_penalty = check_float("frequency_penalty", frequency_penalty)
    if not -2.0 <= frequency_penalty <= 2.0:
        raise InvalidRequestError(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
    repetition_penalty = check_float("repetition_penalty", repetition_penalty)
    if repetition_penalty <= 0.0:
        raise InvalidRequestError(
            f"repetition_penalty must be greater than zero, got {repetition_penalty}."
        )
    return presence_penalty, frequency_penalty, repetition_penalty


def verify_truncation(
    temperature: float, top_p: float, top_k: int, min_p: float
) -> tuple[float, float, int, float]:
    temperature = check_float("temperature", temperature)
    if temperature < 0.0:
        raise InvalidRequestError(f"temperature must be non-negative, got {temperature}.")
    top_p = check_float("top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = check_int("top_k", top_k)
    if top_k < -1:
        raise InvalidRequestError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = check_float("min_p", min_p)
    if not 0.0 <= min_p <= 1.0:
        raise InvalidRequestError(f"min_p must be in [0, 1], got {min_p}.")
    return temperature, top_p, max(top_k, 0), min_p


def verify_lengths(max_tokens: int | None, min_tokens: int) -> tuple[int | None, int]:
    if max_tokens is not None and check_int("max_tokens", max_tokens) < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}.")
    if check_int("min_tokens", min_tokens) < 0:
        raise InvalidRequestError(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}."
        )
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    return max_tokens, min_tokens
