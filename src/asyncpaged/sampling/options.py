"""The sampling options the scheduler sends with each row (:class:`SamplingOptions`), the keys of
seeded rows' generators (:func:`derive_generator_key`, :func:`salt_generator_key`) and what a
penalty reads of a row's history (:data:`SeenTokens`). Leaf types: this module imports nothing
of the engine."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, SupportsIndex

import numpy as np
import torch

__all__ = [
    "SAMPLING_EPS",
    "SamplingOptions",
    "SeenTokens",
    "derive_generator_key",
    "salt_generator_key",
    "splitmix64",
]

SeenTokens = tuple[np.ndarray, np.ndarray]
"""A row's penalty history as the penalties read it: the distinct token ids it has seen (prompt
and output), and how often each occurs in its output."""

SAMPLING_EPS = 1e-5
"""Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``)."""

MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingOptions:
    """One sequence's sampling options for one step (numbers only; the engine fills them in).

    ``top_k`` 0 = off; ``num_logprobs`` = top logprobs to return besides the sampled token
    (``None``: none, and no sampled-token logprob unless the step asks for it). The engine sets
    ``min_tokens_mask_ids`` (EOS + stop token ids) only while fewer than ``min_tokens`` tokens
    were generated. ``prompt_token_ids`` / ``output_token_ids`` feed the penalties; with
    ``history_seq`` set the runner keeps that sequence's penalty history between steps
    (``worker/input_batch``): ``output_token_ids`` is empty and each step's row carries what
    its output added (``SequenceStep.history``), so the options need not change per token.
    ``generator_key`` seeds this row's generator when ``seed`` is set (see
    ``derive_generator_key``); it is ignored otherwise. With ``key_from_position`` (the
    sequence's index in its request, its prompt length) the runner derives it from the row's
    position instead (``with_generator_keys``), so the options stay the same from step to step.
    Logit controls (vLLM's): only ``allowed_token_ids`` keep their logits (None: all),
    ``logit_bias`` (token id, bias) pairs are added, ``banned_token_ids`` (the bad words' next
    tokens this step) get -inf; all before the penalties, none in the raw logprobs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int | None = None
    min_tokens_mask_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    history_seq: int | None = None
    generator_key: int = 0
    key_from_position: tuple[int, int] | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    banned_token_ids: tuple[int, ...] = ()
    token_bitmask: torch.Tensor | None = None  # [ceil(V / 32)] int32: structured outputs
    # The request's own processors, (output_token_ids, logits [V]) -> logits [V], after the rest
    logits_processors: tuple[Callable[[list[int], torch.Tensor], torch.Tensor], ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be non-negative, got {self.num_logprobs}.")

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickled (for the runner's process) with the bitmask as a numpy array: a tensor
        pickles its whole storage, and a step's bitmasks are views of one buffer, so each
        row would carry every row's mask (6.3 MB a step at 128 rows of 96 words)."""
        mask = self.token_bitmask
        if mask is None:
            return object.__reduce_ex__(self, protocol)
        return _with_bitmask, (dataclasses.replace(self, token_bitmask=None), mask.cpu().numpy())

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_logit_controls(self) -> bool:
        """Whether logit_bias, allowed_token_ids, banned tokens or a grammar's bitmask move this
        row's logits."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids is not None
            or self.banned_token_ids
            or self.token_bitmask is not None
            or bool(self.logits_processors)
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def splitmix64(x: int) -> int:
    """SplitMix64's output function: a well-mixed 64-bit value of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_generator_key(seed: int, seq_index: int, num_generated_tokens: int) -> int:
    """A 63-bit generator seed for one draw: a pure function of the request's seed, the
    sequence's index within the request (``n > 1``) and how many tokens it has generated.

    Being a function of these alone (no generator state carried between steps), a seeded
    sequence draws the same tokens however it is batched and after preemption by recompute.
    """
    key = _sequence_key(seed, seq_index)
    key = splitmix64(key ^ (num_generated_tokens & MASK64))
    return key >> 1


@functools.lru_cache(maxsize=4096)
def _sequence_key(seed: int, seq_index: int) -> int:
    """The part of ``derive_generator_key`` that stays the same for a sequence's every draw."""
    return splitmix64(splitmix64(seed & MASK64) ^ (seq_index & MASK64))


def salt_generator_key(generator_key: int, salt: int) -> int:
    """A 63-bit generator seed derived from ``generator_key`` for another use of the same draw
    position (for example speculative decoding's acceptance test), independent of the stream
    ``generator_key`` itself seeds."""
    return splitmix64((generator_key ^ splitmix64(salt & MASK64)) & MASK64) >> 1


def _with_bitmask(options: SamplingOptions, mask: np.ndarray) -> SamplingOptions:
    """Unpickles :meth:`SamplingOptions.__reduce_ex__`."""
    return dataclasses.replace(options, token_bitmask=torch.from_numpy(mask))
