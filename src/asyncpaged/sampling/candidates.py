"""Which rows the screened LM head's top-k candidates can sample, and their probabilities.

``is_screenable`` admits the rows for which ``sampler.sample_from_candidates`` gives exactly the
token ``sample`` gives; ``screened_top_k`` is the k to screen each row for. ``_candidate_probs``
(with ``_top_p_of_candidates``) is ``random_probs`` computed at the candidates alone, summing over
full-width rows that hold -inf wherever ``sample`` has -inf after top-k. The random draws at the
candidates and the race itself stay in ``sampler``, beside the full draws they must equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from asyncpaged.sampling.logits import stable_sort_rows
from asyncpaged.sampling.stages import _NEG_INF

if TYPE_CHECKING:
    from asyncpaged.sampling.options import SamplingOptions

MAX_SCREENED_TOP_K = 64
"""Largest top-k sampled from screened candidates (more candidates to rescore, less gain)."""


def is_screenable(opt: SamplingOptions | None, vocab_size: int) -> bool:
    """Whether ``sample_from_candidates`` gives this row exactly the token ``sample`` gives it.

    Greedy rows qualify, and random rows with ``0 < top_k <= MAX_SCREENED_TOP_K`` (and
    ``top_k < vocab_size``, else top-k is off), any temperature, top-p and seed. Not: rows asking
    for logprobs (the log-softmax normaliser sums over every token), penalties or min-tokens
    masks (they move logits after the LM head, so the screen's bounds no longer hold), min-p
    (applied before top-k against the softmax over the whole vocabulary). The caller must also
    route rows whose step wants the sampled token's logprob to ``sample``.
    """
    if opt is None:
        return True
    if (
        opt.num_logprobs is not None
        or opt.has_penalties
        or opt.min_tokens_mask_ids
        or opt.has_logit_controls
    ):
        return False
    if opt.is_greedy:
        return True
    return 0 < opt.top_k <= MAX_SCREENED_TOP_K and opt.top_k < vocab_size and opt.min_p == 0.0


def screened_top_k(options: Sequence[SamplingOptions | None]) -> list[int]:
    """The k to screen each row for: 1 for greedy rows, ``top_k`` for random ones."""
    return [1 if o is None or o.is_greedy else o.top_k for o in options]


def _candidate_probs(
    ids: torch.Tensor,
    logits: torch.Tensor,
    outside_bound: torch.Tensor,
    opts: Sequence[SamplingOptions],
    vocab_size: int,
) -> torch.Tensor | None:
    """``_random_probs`` step by step, at the candidates: [R, C] (padding: 0), or None."""
    device, num_rows = logits.device, logits.shape[0]
    temperature = torch.tensor([o.temperature for o in opts], dtype=torch.float32, device=device)
    logits = logits / temperature[:, None]  # the same division as on the full row (pads: -inf)
    top_k = torch.tensor([o.top_k for o in opts], dtype=torch.int64, device=device)
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])  # [R, 1]
    # Division by a positive number is monotone: outside tokens stay <= outside_bound / T.
    if not bool((outside_bound[:, None] / temperature[:, None] < kth).all()):
        return None
    logits = logits.masked_fill(logits < kth, _NEG_INF)  # top-k, boundary ties kept
    if any(o.top_p < 1.0 for o in opts):
        top_p = torch.tensor([o.top_p for o in opts], dtype=torch.float32, device=device)
        logits = _top_p_of_candidates(logits, top_p, vocab_size)
    is_pad = ids == vocab_size
    safe_ids = ids.masked_fill(is_pad, 0)
    row_ids = torch.arange(num_rows, device=device)[:, None].expand_as(ids)
    full = torch.full((num_rows, vocab_size), _NEG_INF, dtype=torch.float32, device=device)
    full[row_ids[~is_pad], ids[~is_pad]] = logits[~is_pad]  # [R, V]: sample's row after top-p
    return torch.softmax(full, dim=-1).gather(1, safe_ids).masked_fill_(is_pad, 0.0)


def _top_p_of_candidates(
    logits: torch.Tensor, top_p: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """``apply_top_k_top_p``'s top-p half on top-k-masked candidates [R, C] (vocab ``V``).

    Its ascending stable sort puts the top-k-kept tokens last, by (value, id), after V - kept
    -inf entries; sorting the candidates (ascending ids, -inf for the rest) gives the same tail,
    placed at the end of a full -inf row so the softmax and cumulative sum see that very row::

        sample:      [ -inf ... -inf | -inf  kept kept kept ]   (V wide)
        candidates:                  [ -inf  kept kept kept ]   (C wide, written at V - C)
    """
    num_rows, width = logits.shape
    ordered, order = stable_sort_rows(logits)  # [R, C]
    logits_sort = torch.full((num_rows, vocab_size), _NEG_INF, device=logits.device)
    logits_sort[:, vocab_size - width :] = ordered
    cumulative = torch.softmax(logits_sort, dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, logits_sort[:, vocab_size - width :])
