"""Sampling parameters for text generation, with vLLM's names, defaults and validation messages.

A vLLM user should be able to write ``SamplingParams(temperature=0.8, top_p=0.95, stop=["\\n"])``
unchanged. Every check runs at construction and raises
:class:`~asyncpaged.errors.InvalidRequestError` (a ``ValueError``), so a bad request is refused
before anything is queued. Instances are frozen and hashable; ``dataclasses.replace`` builds a new,
re-validated one.

Normalizations made at construction (as vLLM does, unless noted):

* ``stop``: ``None`` -> ``()``, ``"x"`` -> ``("x",)``, a sequence -> a tuple (order kept).
* ``stop_token_ids``: ``None`` -> ``()``, otherwise a tuple with duplicates dropped (first kept).
* ``top_k == -1`` -> ``0`` (vLLM quietly accepts -1 as "disabled"; 0 is the one stored value).
* ``seed == -1`` -> ``None``.
* greedy (``temperature < 1e-5``): ``top_p = 1.0``, ``top_k = 0``, ``min_p = 0.0``; they would
  not change an argmax.

Not taken from vLLM: temperatures in (0, 0.01) are kept as given (vLLM raises them to 0.01 with a
log line); no upper bound on ``temperature`` (recent vLLM caps it at 2); ``logprobs=-1`` and
``prompt_logprobs=-1`` ("whole vocabulary") are refused; int-typed fields refuse ``bool`` and
float-typed ones refuse NaN/inf.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, cast

from asyncpaged.errors import InvalidRequestError
from asyncpaged.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

__all__ = [
    "MODEL_DEFAULT_FIELDS",
    "BeamSearchParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
]

_SAMPLING_EPS = 1e-5
"""Temperatures below this mean greedy sampling (vLLM's ``_SAMPLING_EPS``)."""

LogitsProcessor = Callable[[list[int], "torch.Tensor"], "torch.Tensor"]
"""``(output_token_ids, logits [V]) -> logits [V]``: per request, run in the executor's thread."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1  # the range torch.Generator.manual_seed accepts


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


class RequestOutputKind(enum.IntEnum):
    """What each streamed ``RequestOutput`` carries (vLLM's values)."""

    CUMULATIVE = 0
    """Every output carries the whole text and all token ids generated so far."""
    DELTA = 1
    """Every output carries only what is new since the previous output."""
    FINAL_ONLY = 2
    """Only the final output is sent, with everything."""


class SamplingType(enum.IntEnum):
    """How the sampler picks tokens for a request (vLLM's values)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


MODEL_DEFAULT_FIELDS = frozenset(MODEL_DEFAULTS)
"""The fields a model's generation config supplies where the caller set none."""


def verify_thinking_budget(
    budget: int | None,
    structured_outputs: object,
    logprobs: int | None,
    n: int,
    best_of: int | None,
) -> int | None:
    """``thinking_token_budget``: None or an int >= 0, without what the end marker it forces
    (tokens appended unsampled) cannot serve."""
    if budget is None:
        return None
    if check_int("thinking_token_budget", budget) < 0:
        raise InvalidRequestError(f"thinking_token_budget must be non-negative, got {budget}.")
    conflict = (
        "structured_outputs" if structured_outputs is not None
        else "logprobs" if logprobs is not None
        else "best_of > n" if best_of is not None and best_of > n
        else None
    )  # fmt: skip
    if conflict is not None:
        raise InvalidRequestError(
            f"thinking_token_budget cannot be combined with {conflict}: the end marker it "
            "forces is appended unsampled (no logprob, not checked by a grammar)."
        )
    return budget


def _verify_counts(
    n: int, best_of: int | None, output_kind: RequestOutputKind
) -> tuple[int, int | None, RequestOutputKind]:
    n = check_int("n", n)
    if n < 1:
        raise InvalidRequestError(f"n must be at least 1, got {n}.")
    if best_of is not None:
        best_of = check_int("best_of", best_of)
        if best_of < n:
            raise InvalidRequestError(
                f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}."
            )
    try:
        output_kind = RequestOutputKind(output_kind)
    except ValueError:
        raise InvalidRequestError(
            f"output_kind must be a RequestOutputKind, got {output_kind!r}."
        ) from None
    if best_of is not None and best_of != n and output_kind == RequestOutputKind.DELTA:
        raise InvalidRequestError("best_of must equal n to use output_kind=DELTA")
    return n, best_of, output_kind


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class SamplingParams:
    """Sampling parameters for one request, following vLLM's ``SamplingParams``.

    Fields (vLLM's defaults):

    * ``n=1``: number of output sequences to return.
    * ``best_of=None``: sequences to generate, of which the ``n`` best are returned; ``None``
      means ``n`` (see ``num_sequences``); must be ``>= n``.
    * ``presence_penalty=0.0``, ``frequency_penalty=0.0``: in [-2, 2]; > 0 discourages repeats of
      generated tokens (OpenAI semantics).
    * ``repetition_penalty=1.0``: > 0; > 1 discourages tokens of the prompt and the output.
    * ``temperature=1.0``: >= 0; below 1e-5 means greedy (``is_greedy``).
    * ``top_p=1.0`` in (0, 1]; ``top_k=0`` (0 disables; -1 accepted and stored as 0);
      ``min_p=0.0`` in [0, 1]. Reset to these disabled values when greedy.
    * ``seed=None``: per-request generator seed (-1 is stored as ``None``).
    * ``stop=None``: stop strings; stored as a tuple. Generation stops when the output text
      contains one; the text is cut before it (after it with ``include_stop_str_in_output``).
    * ``stop_token_ids=None``: token ids that stop generation; stored as a tuple.
    * ``ignore_eos=False``: keep generating after the EOS token.
    * ``max_tokens=16``: output tokens per sequence, >= 1; ``None`` means up to the model length.
    * ``min_tokens=0``: output tokens generated before EOS, ``stop_token_ids`` or stop strings
      can end a sequence; in [0, max_tokens].
    * ``logprobs=None``: number of top log probabilities to return per output token besides the
      sampled token's own (which is always returned when this is not ``None``); >= 0.
    * ``prompt_logprobs=None``: k >= 0 returns ``RequestOutput.prompt_logprobs``: for each prompt
      position after the first, the prompt token's logprob and rank given the tokens before it,
      and the top k there (0: the prompt token alone). Such a request reads no prefix-cache
      blocks until its prompt logprobs are computed (as in vLLM); the engine caps k (and
      ``logprobs``) at ``EngineConfig.max_logprobs``.
    * ``include_stop_str_in_output=False``, ``skip_special_tokens=True``,
      ``spaces_between_special_tokens=True``: detokenization options.
    * ``output_kind=RequestOutputKind.CUMULATIVE``: what each streamed output carries.
    * ``logit_bias=None``: token id -> bias added to its logit before sampling (stored as sorted
      ``(id, bias)`` pairs); ``allowed_token_ids=None``: only these may be sampled;
      ``bad_words=None``: words never generated (vLLM's rule: each word is tokenized with and
      without a leading space; its last token is banned whenever the output ends with the rest).
      Token ids must be in the model's vocabulary (checked by the engine).
    * ``detokenize=True``: False leaves ``text`` empty (ids only; no stop strings, no
      ``Logprob.decoded_token``). ``truncate_prompt_tokens=None``: an int k keeps only the
      prompt's last k tokens (left truncation, after tokenizing).
    * ``logits_processors=None``: callables ``(output_token_ids, logits) -> logits`` applied to
      each of the request's rows after the logit controls, in the executor's thread; one that
      raises fails its own request (``RequestFailedError``) and no other.
    * ``structured_outputs=None``: a ``StructuredOutputsParams`` constraint (JSON schema, regex,
      choice, grammar, any JSON object) the output follows (``asyncpaged.structured_outputs``).
    * ``thinking_token_budget=None``: an int N >= 0 ends a reasoning model's thinking after N
      tokens: the engine appends its reasoning parser's end marker (``</think>``) to the output
      and the model goes on with the answer (docs/api.md, "Reasoning models"). It needs an
      engine with a reasoning parser, and takes no ``structured_outputs``, ``logprobs`` or
      ``best_of > n`` (the appended tokens are not sampled: they have no logprob, and a
      grammar would have to accept them).

    Model defaults: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
    ``max_tokens`` left unset (``explicit_fields`` records the ones given) take the model's
    ``generation_config.json`` values in the engine (``with_defaults``), as in vLLM. A
    ``dataclasses.replace`` copy passes every field, so it counts them all as given.
    """

    n: int
    best_of: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    output_kind: RequestOutputKind
    logit_bias: tuple[tuple[int, float], ...]
    allowed_token_ids: tuple[int, ...] | None
    bad_words: tuple[str, ...]
    structured_outputs: StructuredOutputsParams | None
    detokenize: bool
    truncate_prompt_tokens: int | None
    logits_processors: tuple[LogitsProcessor, ...]
    thinking_token_budget: int | None
    #: The model-default fields (``MODEL_DEFAULT_FIELDS``) the caller gave explicitly; the rest
    #: take the model's ``generation_config.json`` values in the engine (``with_defaults``).
    explicit_fields: frozenset[str] = field(init=False, compare=False, repr=False)

    def __init__(
        self,
        *,
        n: int = 1,
        best_of: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = cast(float, MODEL_DEFAULTS["repetition_penalty"]),
        temperature: float = cast(float, MODEL_DEFAULTS["temperature"]),
        top_p: float = cast(float, MODEL_DEFAULTS["top_p"]),
        top_k: int = cast(int, MODEL_DEFAULTS["top_k"]),
        min_p: float = cast(float, MODEL_DEFAULTS["min_p"]),
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        ignore_eos: bool = False,
        max_tokens: int | None = cast(int, MODEL_DEFAULTS["max_tokens"]),
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None = None,
        allowed_token_ids: Iterable[int] | None = None,
        bad_words: str | Sequence[str] | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
        detokenize: bool = True,
        truncate_prompt_tokens: int | None = None,
        logits_processors: Sequence[LogitsProcessor] | None = None,
        thinking_token_budget: int | None = None,
    ) -> None:
        """Validate and normalize; raise ``InvalidRequestError`` naming the first bad value."""
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                 "repetition_penalty": repetition_penalty, "max_tokens": max_tokens}  # fmt: skip
        explicit = frozenset(k for k, v in given.items() if v is not MODEL_DEFAULTS[k])
        object.__setattr__(self, "explicit_fields", explicit)
        n, best_of, output_kind = _verify_counts(n, best_of, output_kind)
        penalties = verify_penalties(presence_penalty, frequency_penalty, repetition_penalty)
        temperature, top_p, top_k, min_p = verify_truncation(temperature, top_p, top_k, min_p)
        max_tokens, min_tokens = verify_lengths(max_tokens, min_tokens)
        if seed is not None:
            seed = check_int("seed", seed)
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise InvalidRequestError(f"seed must be in [-2**63, 2**64 - 1], got {seed}.")
            if seed == -1:
                seed = None
        if logprobs is not None and check_int("logprobs", logprobs) < 0:
            raise InvalidRequestError(f"logprobs must be non-negative, got {logprobs}.")
        if prompt_logprobs is not None and check_int("prompt_logprobs", prompt_logprobs) < 0:
            raise InvalidRequestError(
                f"prompt_logprobs must be non-negative, got {prompt_logprobs} (-1, the whole "
                "vocabulary, is not supported)."
            )
        if temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change an argmax, so store them disabled.
            top_p, top_k, min_p = 1.0, 0, 0.0
            # n > 1 is allowed (n identical completions sharing the prompt's blocks); extra
            # best_of candidates would be identical too.
            if best_of is not None and best_of > n:
                raise InvalidRequestError(
                    f"best_of must equal n when using greedy sampling, got n={n} and "
                    f"best_of={best_of}."
                )
        values: dict[str, object] = {
            "n": n,
            "best_of": best_of,
            "presence_penalty": penalties[0],
            "frequency_penalty": penalties[1],
            "repetition_penalty": penalties[2],
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "seed": seed,
            "stop": normalize_stop(stop),
            "stop_token_ids": normalize_stop_token_ids(stop_token_ids),
            "ignore_eos": ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "include_stop_str_in_output": include_stop_str_in_output,
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "output_kind": output_kind,
            "logit_bias": normalize_logit_bias(
                dict(logit_bias) if isinstance(logit_bias, tuple) else logit_bias
            ),
            "allowed_token_ids": normalize_allowed(allowed_token_ids),
            "bad_words": normalize_bad_words(bad_words),
            "structured_outputs": structured_outputs,
            "detokenize": detokenize,
            "truncate_prompt_tokens": truncate_prompt_tokens,
            "logits_processors": as_tuple(
                "logits_processors", logits_processors or (), "a list of callables"
            ),
            "thinking_token_budget": verify_thinking_budget(
                thinking_token_budget, structured_outputs, logprobs, n, best_of
            ),
        }
        if not all(callable(p) for p in values["logits_processors"]):  # type: ignore[attr-defined]
            raise InvalidRequestError(
                "logits_processors must be callables (output_token_ids, logits) -> logits."
            )
        if truncate_prompt_tokens is not None and (
            check_int("truncate_prompt_tokens", truncate_prompt_tokens) < 1
        ):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be at least 1, got {truncate_prompt_tokens}."
            )
        if not detokenize and values["stop"]:
            raise InvalidRequestError("stop strings are only supported when detokenize is True.")
        if structured_outputs is not None and not isinstance(
            structured_outputs, StructuredOutputsParams
        ):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(structured_outputs).__name__}."
            )
        for name, value in values.items():
            if name in BOOL_FIELDS:
                check_bool(name, value)
            if isinstance(value, DefaultFloat | DefaultInt):  # store plain numbers
                object.__setattr__(self, name, type(value).__mro__[1](value))
            else:
                object.__setattr__(self, name, value)

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These parameters with ``defaults`` (a model's generation config: names from
        ``MODEL_DEFAULT_FIELDS``) in every field the caller left unset; ``self`` if none."""
        unset = {k: v for k, v in defaults.items() if k not in self.explicit_fields}
        if not unset:
            return self
        assert set(unset) <= MODEL_DEFAULT_FIELDS, f"not model defaults: {sorted(unset)}"
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        for name in MODEL_DEFAULT_FIELDS - self.explicit_fields:
            kwargs[name] = MODEL_DEFAULTS[name]  # still unset after the merge unless given
        kwargs.update(unset)
        merged = SamplingParams(**kwargs)
        object.__setattr__(merged, "explicit_fields", self.explicit_fields)
        return merged

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` (validated as at construction); the fields given explicitly
        stay so, and so do the changed ones."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        kwargs.update(changes)
        copy = SamplingParams(**kwargs)
        object.__setattr__(copy, "explicit_fields", self.explicit_fields | frozenset(changes))
        return copy

    @property
    def num_sequences(self) -> int:
        """Sequences the engine generates for the request: ``best_of``, or ``n`` when unset."""
        return self.n if self.best_of is None else self.best_of

    @property
    def is_greedy(self) -> bool:
        """True when ``temperature < 1e-5``: the sampler takes the argmax."""
        return self.temperature < _SAMPLING_EPS

    @property
    def is_plain_greedy(self) -> bool:
        """The argmax of the raw logits at every step, nothing else asked per token: greedy,
        no penalties, no min_tokens, no logit controls (bias, allowed ids, bad words,
        processors), no logprobs. Such a row's sampling options are None (the fast path)."""
        return (
            self.is_greedy and self.logprobs is None and self.min_tokens == 0
            and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0 and not self.logit_bias
            and self.allowed_token_ids is None and not self.bad_words
            and not self.logits_processors
        )  # fmt: skip

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM_SEED (a seed was given) or RANDOM, as in vLLM."""
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def output_text_buffer_length(self) -> int:
        """Characters of text held back from streamed output until the sequence finishes.

        ``max(len(s) for s in stop) - 1`` when there are stop strings that are cut from the
        output, else 0: a stop string completed by a later token can begin at most that many
        characters before the text seen so far ends, and those characters must not have been sent.
        """
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BeamSearchParams:
    """Beam search parameters (vLLM's ``BeamSearchParams``), validated at construction.

    ``beam_width`` beams of up to ``max_tokens`` tokens; finished beams are ranked by cumulative
    logprob divided by ``length ** length_penalty``. ``temperature`` 0 keeps the raw logprobs.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | Literal["never"] = False  # transformers' semantics (core/beam_search)

    def __post_init__(self) -> None:
        """Raise ``InvalidRequestError`` for a bad value; store floats as ``float``."""
        if check_int("beam_width", self.beam_width) < 1:
            raise InvalidRequestError(f"beam_width must be at least 1, got {self.beam_width}.")
        if check_int("max_tokens", self.max_tokens) < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}."
            )
        temperature = check_float("temperature", self.temperature)
        if temperature < 0.0:
            raise InvalidRequestError(f"temperature must be non-negative, got {temperature}.")
        if temperature != 0.0:
            raise InvalidRequestError("beam search supports temperature 0 only.")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(
            self, "length_penalty", check_float("length_penalty", self.length_penalty)
        )
