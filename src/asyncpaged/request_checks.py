"""Checks a request must pass at ``generate``, before anything is built or queued for it.

Each is O(1) or O(what the request carries, already bounded), so a hostile request costs the
event loop microseconds: sizes are checked before any per-sequence state exists, and a text
prompt's length in characters before it is encoded or tokenized (``max_prompt_chars``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncpaged.errors import InvalidRequestError
from asyncpaged.sampling_params import SamplingParams
from asyncpaged.sched.request import StopCriteria

__all__ = [
    "RequestLimits",
    "check_cache_salt",
    "check_group_width",
    "check_request_id",
    "check_text_prompt",
    "max_prompt_chars",
]


def _is_unicode(text: str) -> bool:
    """True if ``text`` encodes as UTF-8 (no lone surrogate such as ``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidRequestError(f"request_id must be a str, got {type(request_id).__name__}.")
    if not _is_unicode(request_id):
        raise InvalidRequestError("request_id must be valid Unicode (it has a lone surrogate).")
    return request_id


def check_cache_salt(salt: object) -> str | None:
    """A cache salt is a str of valid Unicode without NUL characters (or None)."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise InvalidRequestError(
            f"cache_salt must be a str without NUL characters, got {type(salt).__name__}."
        )
    if "\x00" in salt or not _is_unicode(salt):
        raise InvalidRequestError(
            "cache_salt must be a str without NUL characters or lone surrogates."
        )
    return salt


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The longest text prompt that could fit: ``max_model_len`` tokens of the vocabulary's
    longest token (in characters of its vocabulary string, which for byte-level BPE is one per
    byte, so never fewer than the text's characters it stands for). A text longer than this
    cannot tokenize into fewer than ``max_model_len`` tokens unless the tokenizer's normalizer
    deletes characters; it is refused before it is encoded or tokenized. Call it off the loop:
    it reads the whole vocabulary once."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without get_vocab: a generous fixed bound
        return max_model_len * 64
    longest = max((len(t) for t in vocab), default=1)
    return max_model_len * max(longest, 1)


def check_text_prompt(text: str, max_chars: int, max_model_len: int) -> None:
    """Refuse a text prompt that is empty, too long to fit (by its length, O(1)), or not valid
    Unicode (a lone surrogate, which tokenizers raise on), before any tokenizing."""
    if not text:
        raise InvalidRequestError("prompt must not be empty.")
    if len(text) > max_chars:
        raise InvalidRequestError(
            f"prompt is {len(text)} characters; more than max_model_len ({max_model_len}) "
            f"tokens of the longest token in the vocabulary ({max_chars} characters) cannot fit."
        )
    if not _is_unicode(text):
        raise InvalidRequestError("prompt must be valid Unicode text (it has a lone surrogate).")


def check_group_width(
    num_sequences: int, what: str, max_num_seqs: int, max_num_batched_tokens: int
) -> None:
    """A request's sequences run together (every decode step takes one token of each), so a
    group wider than ``max_num_seqs`` or the step's token budget could never be scheduled."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    if num_sequences > limit:
        raise InvalidRequestError(
            f"{what}={num_sequences} needs {num_sequences} sequences in one step, more than "
            f"this engine schedules (max_num_seqs={max_num_seqs}, "
            f"max_num_batched_tokens={max_num_batched_tokens})."
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLimits:
    """What the loaded model and the KV cache allow a request (set once the engine starts).

    ``generate`` checks sampling parameters and prompts of ids with it; the intake actor checks
    tokenized prompts with it in its worker thread (it holds no reference to the engine).
    """

    vocab_size: int
    max_model_len: int
    block_size: int
    num_device_blocks: int
    max_logprobs: int  # -1: no limit
    eos_token_ids: frozenset[int]

    def check_logprobs(self, params: SamplingParams) -> None:
        """``logprobs`` and ``prompt_logprobs`` at most ``EngineConfig.max_logprobs`` (vLLM's)."""
        limit = self.max_logprobs
        for name, num in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if num is not None and limit != -1 and num > limit:
                raise InvalidRequestError(
                    f"Requested {name} logprobs of {num}, which is greater than max allowed: "
                    f"{limit}."
                )

    def check_vocab(self, params: SamplingParams) -> None:
        """Token ids of the logit controls and stop_token_ids (masked while ``min_tokens``
        are generated) must be in the model's vocabulary."""
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):  # fmt: skip
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} token ids must be in [0, {self.vocab_size}), got {bad[:5]}."
                )

    def check_ids(self, ids: Sequence[int], params: SamplingParams) -> int:
        """Validate prompt token ids; returns the request's max new tokens. The length is
        checked before the ids are looked at (O(1) for a prompt far too long). Runs on the
        loop for id prompts and in the intake's worker thread for tokenized ones."""
        if not ids:
            raise InvalidRequestError("prompt must not be empty.")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len})."
            )
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}."
            )
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})."
            )
        bs = self.block_size
        # The prompt's full blocks are shared; each sequence owns the rest.
        need = len(ids) // bs + params.num_sequences * (-(-(len(ids) % bs + max_tokens) // bs))
        if need > self.num_device_blocks:
            raise InvalidRequestError(
                f"the request needs up to {need} KV blocks but the cache has "
                f"{self.num_device_blocks}; lower max_tokens or raise the KV cache size."
            )
        return max_tokens

    def stop_criteria(self, params: SamplingParams, max_tokens: int) -> StopCriteria:
        return StopCriteria(
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            eos_token_ids=self.eos_token_ids,
            ignore_eos=params.ignore_eos,
            stop_token_ids=frozenset(params.stop_token_ids),
            max_model_len=self.max_model_len,
        )
