"""The executor's per-row sampling options, built from a request's sampling parameters and its
sequence's history: the fast path's ``None`` for plain greedy, min-tokens masks, penalty
histories, seeded generator keys, bad words (tokenized once per distinct word list, see
:class:`BadWordsCache`) and the verification rows of a speculative sequence."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from asyncpaged.sampling.options import SamplingOptions, derive_generator_key
from asyncpaged.sampling_params import SamplingParams
from asyncpaged.sched.request import Sequence as Seq


class BadWordsCache:
    """Token ids of requests' bad words, tokenized once per distinct word list (with the
    loop thread's tokenizer); cleared when it holds 1024 lists."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}

    def ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Token ids of a request's bad words, tokenized once per distinct word list."""
        if not words:
            return ()
        ids = self._ids.get(words)
        if ids is None:
            if len(self._ids) >= 1024:
                self._ids.clear()
            ids = self._ids[words] = bad_words_token_ids(self._tokenizer, words)
        return ids


def verify_options(
    params: SamplingParams,
    seq: Seq,
    draft: tuple[int, ...],
    eos_token_ids: frozenset[int],
    bad_words_ids: tuple[tuple[int, ...], ...],
) -> tuple[SamplingOptions | None, ...]:
    """The sampling options of a speculative sequence's verification rows: row ``j`` as
    a plain step would build them after the first ``j`` proposals (penalty history,
    min-tokens mask, bad words, the seed's stream position); () when all are plain."""
    context = list(seq.token_ids)
    options = []
    for j in range(len(draft) + 1):
        options.append(sampling_options(params, context, seq.num_prompt_tokens, seq.index,
                                        eos_token_ids, bad_words_ids))  # fmt: skip
        if j < len(draft):
            context.append(draft[j])
    return () if all(o is None for o in options) else tuple(options)


def sampling_options(
    params: SamplingParams,
    token_ids: list[int],
    num_prompt: int,
    index: int,
    eos_token_ids: frozenset[int],
    bad_words_ids: tuple[tuple[int, ...], ...] = (),
    token_bitmask: torch.Tensor | None = None,
    prompt: tuple[int, ...] | None = None,
    history_seq: int | None = None,
    *,
    positional_key: bool = False,
) -> SamplingOptions | None:
    """The executor's per-row sampling options; None for plain greedy (the fast path).
    ``prompt``: ``token_ids[:num_prompt]`` as a tuple, when the caller keeps one (the
    penalties read the prompt every step; see ``step_builder``). ``history_seq``: the row
    may keep its penalty history in the runner (``input_batch``) as that sequence: a
    penalized row then carries no output (the row's ``SequenceStep.history`` does).
    ``positional_key``: a seeded row's generator key is left to the runner, which derives the
    same one from the row's position (``SamplingOptions.key_from_position``), so the options
    do not change per token."""
    if token_bitmask is None and params.is_plain_greedy:
        return None
    num_generated = len(token_ids) - num_prompt
    # The output is sliced only for bad words: a per-step copy of every history otherwise.
    banned = banned_next_tokens(bad_words_ids, token_ids[num_prompt:]) if bad_words_ids else ()
    controlled = bool(
        params.logit_bias
        or params.allowed_token_ids is not None
        or banned
        or token_bitmask is not None
        or params.logits_processors
    )
    mask: tuple[int, ...] = ()
    if num_generated < params.min_tokens:
        mask = tuple(params.stop_token_ids)
        if not params.ignore_eos:
            mask = (*mask, *sorted(eos_token_ids - set(mask)))
        if token_bitmask is not None and grammar_allows_only(token_bitmask, mask):
            mask = ()  # the grammar may only end here: min_tokens yields (as in vLLM)
    penalized = (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )
    if (
        params.is_greedy
        and not penalized
        and not mask
        and not controlled
        and params.logprobs is None
    ):
        return None
    if not penalized or params.logits_processors:
        history_seq = None  # nothing to keep, or the processors read the output
    return SamplingOptions(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        num_logprobs=params.logprobs,
        min_tokens_mask_ids=mask,
        prompt_token_ids=(
            (prompt if prompt is not None else tuple(token_ids[:num_prompt])) if penalized else ()
        ),
        output_token_ids=(
            tuple(token_ids[num_prompt:])
            if (penalized and history_seq is None) or params.logits_processors
            else ()
        ),
        history_seq=history_seq,
        generator_key=derive_generator_key(params.seed, index, num_generated)
        if params.seed is not None and not positional_key
        else 0,
        key_from_position=(index, num_prompt)
        if params.seed is not None and positional_key
        else None,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids,
        banned_token_ids=banned,
        token_bitmask=token_bitmask,
        logits_processors=params.logits_processors,
    )


def grammar_allows_only(bitmask: torch.Tensor | np.ndarray, token_ids: Iterable[int]) -> bool:
    """Whether a grammar's bitmask ([ceil(V / 32)] int32) allows no token but ``token_ids``:
    then its output may only end there (a complete schema), and ``min_tokens``, which bans
    the stop tokens, would leave nothing to sample."""
    row = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
    words = row.view(np.uint32).copy()
    for t in token_ids:
        if t >> 5 < len(words):
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
    return not words.any()


def bad_words_token_ids(tokenizer: Any, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids, as vLLM tokenizes them: the word (left-stripped), and the word
    after a space where that tokenizes into as many tokens, starting with another one."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(ids for ids in out if ids)


def banned_next_tokens(
    bad_words_ids: tuple[tuple[int, ...], ...], output: list[int]
) -> tuple[int, ...]:
    """The last token of every bad word whose other tokens end the output (vLLM's rule: a
    one-token word is always banned)."""
    banned = []
    for ids in bad_words_ids:
        prefix = ids[:-1]
        if len(prefix) <= len(output) and (not prefix or tuple(output[-len(prefix) :]) == prefix):
            banned.append(ids[-1])
    return tuple(dict.fromkeys(banned))
