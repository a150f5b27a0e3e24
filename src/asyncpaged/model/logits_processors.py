"""Logits processors of the sampler, each over a batch of rows ``[R, V]`` float32 (vLLM v1 math).

Every function takes per-row parameters as tensors (or Python sequences for token lists) and
either returns a new tensor or edits ``logits`` in place, as its docstring says. A row whose
parameter is the no-op value (penalty 1.0 / 0.0, ``top_k == V``, ``top_p == 1``, ``min_p == 0``)
comes out bit-identical, so callers may batch rows that do not use a processor with ones that do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NEG_INF = float("-inf")


def token_bin_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Per-row occurrence counts ``[R, V]`` float32 of the given token ids: each row's ids
    converted to an array in C (no padded Python lists), then one ``index_add_`` of ones at
    ``row * V + id`` (sums of ones: exact in float32 in any order)."""
    num_rows = len(token_ids)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    lens = np.fromiter(map(len, token_ids), np.int64, num_rows)
    total = int(lens.sum())
    if total == 0:
        return counts
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids if len(t)])
    assert int(flat.min()) >= 0, "negative token id in a penalty token list"
    assert int(flat.max()) < vocab_size, f"token id >= vocab size {vocab_size} in a penalty list"
    flat += np.repeat(np.arange(num_rows, dtype=np.int64) * vocab_size, lens)
    ones = torch.ones(total, dtype=torch.float32, device=device)
    counts.view(-1).index_add_(0, torch.from_numpy(flat).to(device), ones)
    return counts


def apply_min_tokens_mask(logits: torch.Tensor, mask_ids: Sequence[Sequence[int]]) -> None:
    """In place: ``logits[r, id] = -inf`` for every id in ``mask_ids[r]`` (EOS and stop ids).
    Ids outside the vocabulary (an EOS id a config lists beyond it) cannot be sampled anyway and
    are skipped: a bad id never fails the step."""
    vocab = logits.shape[-1]
    pairs = [(r, i) for r, ids in enumerate(mask_ids) for i in ids if 0 <= i < vocab]
    if not pairs:
        return
    rows, cols = [r for r, _ in pairs], [i for _, i in pairs]
    logits.index_put_(
        (
            torch.tensor(rows, dtype=torch.int64, device=logits.device),
            torch.tensor(cols, dtype=torch.int64, device=logits.device),
        ),
        torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device),
    )


def apply_penalties(
    logits: torch.Tensor,
    *,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; returns new logits ``[R, V]``.

    Repetition (over prompt + output tokens, as transformers and vLLM): a seen token's positive
    logit is divided by the penalty, a negative one multiplied. Frequency/presence (OpenAI's
    definition, over output tokens only): ``logit -= frequency * count`` then
    ``logit -= presence * (count > 0)``. Penalty tensors are ``[R]`` float32.
    """
    vocab_size = logits.shape[1]
    output_counts = token_bin_counts(output_token_ids, vocab_size, logits.device)  # [R, V]
    output_seen = output_counts > 0
    if bool((repetition_penalties != 1.0).any()):
        prompt_counts = token_bin_counts(prompt_token_ids, vocab_size, logits.device)
        seen = output_seen | (prompt_counts > 0)
        penalty = repetition_penalties[:, None]  # [R, 1]
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    else:
        logits = logits.clone()
    logits -= frequency_penalties[:, None] * output_counts
    logits -= presence_penalties[:, None] * output_seen
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p * max probability`` (``min_p`` [R])."""
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [R, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


# Below this many elements torch's own sort is as fast (the key's setup dominates).
_KEYED_SORT_MIN_ELEMENTS = 4096


def stable_sort_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(logits, dim=-1, stable=True)`` (ascending): the same values and the same
    order, ties by index.

    On CPU, for float32 rows of at least a few thousand elements, it sorts one int64 key per
    element instead: the value's bits mapped so that integer order is float order (``-0.0``
    as ``+0.0``, every NaN as one positive NaN: last, as torch sorts them), above the element's
    index. The keys are distinct, so numpy's unstable (SIMD) sort of them is the stable order;
    torch's stable sort of ``[256, 2000]`` took 25 ms on one thread where this takes 4
    (docs/tuning.md, "Sampling")."""
    num_rows, width = logits.shape
    if (
        logits.device.type != "cpu" or logits.dtype != torch.float32
        or num_rows * width < _KEYED_SORT_MIN_ELEMENTS or logits.requires_grad
    ):  # fmt: skip
        return torch.sort(logits, dim=-1, stable=True)
    canonical = logits + 0.0  # a copy, with -0.0 turned into +0.0
    canonical.masked_fill_(canonical.isnan(), float("nan"))
    key = canonical.view(torch.int32).to(torch.int64)
    key ^= (key >> 31) & 0x7FFFFFFF  # a negative float's magnitude bits, reversed
    key <<= 32
    key |= torch.arange(width, dtype=torch.int64)
    key.numpy().sort(axis=-1)  # in place, on the tensor's own memory
    order = key.bitwise_and_(0xFFFFFFFF)
    return logits.gather(1, order), order


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p (vLLM v1 ``apply_top_k_top_p``); returns new logits ``[R, V]``.

    ``top_k`` [R] int64 in 1..V (V = off): keep tokens whose logit is >= the k-th largest (ties at
    the boundary are kept). ``top_p`` [R] float32 in (0, 1] (1 = off): over the top-k-filtered
    distribution, sorted ascending with a stable sort, drop each token whose cumulative
    probability (itself included) is <= ``1 - top_p``; the most likely token is always kept.
    """
    if top_p is None:
        if top_k is None:
            return logits
        max_k = int(top_k.max())
        kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1)[:, None])  # [R, 1]
        return logits.masked_fill(logits < kth, _NEG_INF)
    vocab_size = logits.shape[1]
    logits_sort, order = stable_sort_rows(logits)  # ascending
    if top_k is not None:
        kth = logits_sort.gather(1, (vocab_size - top_k)[:, None])  # [R, 1]
        logits_sort.masked_fill_(logits_sort < kth, _NEG_INF)
    cumulative = torch.softmax(logits_sort, dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, logits_sort)
