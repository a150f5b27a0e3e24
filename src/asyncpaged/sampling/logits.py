"""Logits processors of the sampler, each over a batch of rows ``[R, V]`` float32 (vLLM v1 math).

Every function takes per-row parameters as tensors (or Python sequences for token lists) and
either returns a new tensor or edits ``logits`` in place, as its docstring says. A row whose
parameter is the no-op value (penalty 1.0 / 0.0, ``top_k == V``, ``top_p == 1``, ``min_p == 0``)
comes out bit-identical, so callers may batch rows that do not use a processor with ones that do.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

_NEG_INF = float("-inf")


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
    """Repetition, then frequency and presence penalties; returns new logits ``[R, V]`` (see
    :func:`penalize_rows_`, which edits rows in place)."""
    out = logits.clone(memory_format=torch.contiguous_format)
    penalize_rows_(out, range(out.shape[0]), prompt_token_ids=prompt_token_ids,
                   output_token_ids=output_token_ids, repetition_penalties=repetition_penalties,
                   frequency_penalties=frequency_penalties,
                   presence_penalties=presence_penalties)  # fmt: skip
    return out


def penalize_rows_(
    logits: torch.Tensor,
    rows: Sequence[int],
    *,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    seen: Sequence[tuple[np.ndarray, np.ndarray] | None] | None = None,
) -> None:
    """In place on rows ``rows`` of ``logits`` [N, V] (contiguous): the penalties of row
    ``rows[i]`` are entry ``i`` of the lists and of the ``[len(rows)]`` float32 tensors.
    Where ``seen[i]`` is given, it replaces entry ``i`` of the token lists: the row's distinct
    seen token ids (int64; prompt tokens only where its repetition penalty is not 1) and
    their output counts (float32), as the runner keeps them (``worker/input_batch``).

    Repetition (over prompt + output tokens, as transformers and vLLM): a seen token's positive
    logit is divided by the penalty, a negative one multiplied. Frequency/presence (OpenAI's
    definition, over output tokens only): ``logit -= frequency * count`` then
    ``logit -= presence * (count > 0)``.

    Sparse: only the (row, token) pairs a row has seen are read and written, in the same float32
    operations in the same order as the dense form over ``[R, V]`` (vLLM's), so every seen
    token's logit is bit-identical to it; an unseen token's logit is left as it is (the dense
    form subtracts ``0 * penalty`` there, which changes at most the sign of a zero). The work is
    one sort of the rows' histories, not a dozen passes over ``R x V`` logits: at 256 rows of a
    2000-token vocabulary 1.4 ms instead of 8 (docs/benchmarks.md, "Sampling, penalties")."""
    vocab = logits.shape[1]
    assert logits.is_contiguous(), "penalize_rows_ edits a contiguous [N, V] tensor in place"
    kept = [] if seen is None else [i for i, x in enumerate(seen) if x is not None]
    if kept:  # those rows' lists are not read
        assert seen is not None
        prompt_token_ids = [() if x is not None else p for x, p in zip(seen, prompt_token_ids,
                                                                      strict=True)]  # fmt: skip
        output_token_ids = [() if x is not None else o for x, o in zip(seen, output_token_ids,
                                                                      strict=True)]  # fmt: skip
    keys, out_counts = _seen_pairs(prompt_token_ids, output_token_ids,
                                   repetition_penalties, vocab)  # fmt: skip
    if kept:
        assert seen is not None
        kept_keys, kept_counts = _kept_pairs([x for x in seen if x is not None], kept, vocab)
        keys = np.concatenate([keys, kept_keys])
        out_counts = np.concatenate([out_counts, kept_counts])
    if keys.size == 0:
        return
    local, cols = np.divmod(keys, vocab)  # the pair's entry of ``rows``, its token id
    where = np.asarray(rows, dtype=np.int64)[local] * vocab + cols
    if _on_host(logits):  # numpy's gathers: 2.5x torch's at 115k pairs
        _penalize_pairs_numpy(logits.numpy().reshape(-1), where, local, out_counts,
                              repetition_penalties.numpy(), frequency_penalties.numpy(),
                              presence_penalties.numpy())  # fmt: skip
        return
    pair_rows = torch.from_numpy(local)
    device = logits.device
    where_t, pair_rows = torch.from_numpy(where).to(device), pair_rows.to(device)
    counts = torch.from_numpy(out_counts).to(device)  # float32 [P]
    flat = logits.view(-1)
    values = flat[where_t]
    penalty = repetition_penalties[pair_rows]
    values = torch.where(values > 0, values / penalty, values * penalty)
    values -= frequency_penalties[pair_rows] * counts
    values -= presence_penalties[pair_rows] * (counts > 0)
    flat[where_t] = values


def _on_host(logits: torch.Tensor) -> bool:
    """Whether the penalties run in numpy (CPU tensors; tests force the torch form too)."""
    return logits.device.type == "cpu"


def _penalize_pairs_numpy(
    flat: np.ndarray,
    where: np.ndarray,
    local: np.ndarray,
    counts: np.ndarray,
    repetition: np.ndarray,
    frequency: np.ndarray,
    presence: np.ndarray,
) -> None:
    """The pairs' penalties on a CPU tensor's float32 memory: the same float32 operations in
    the same order as the torch form (elementwise, so the same bits)."""
    values = flat[where]
    penalty = repetition[local]
    values = np.where(values > 0, values / penalty, values * penalty)
    values -= frequency[local] * counts
    values -= presence[local] * (counts > 0)
    flat[where] = values


def _seen_pairs(
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    vocab: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts): each distinct ``row * vocab + token`` a row has seen (its output, and its
    prompt where its repetition penalty is not 1: there the prompt changes nothing), sorted,
    and how often it occurs in the row's output (float32; 0 for prompt-only tokens)."""
    num_rows = len(output_token_ids)
    repeated = (repetition_penalties != 1.0).tolist()
    prompts = [p if r else () for p, r in zip(prompt_token_ids, repeated, strict=True)]
    # One sort of every key doubled, a prompt's plus one: each run of equal keys >> 1 is one
    # pair, its even entries its output occurrences (cheaper than np.unique's argsort).
    tagged = np.concatenate([_row_keys(output_token_ids, num_rows, vocab) << 1,
                             (_row_keys(prompts, num_rows, vocab) << 1) | 1])  # fmt: skip
    if tagged.size == 0:
        return tagged, np.empty(0, dtype=np.float32)
    tagged.sort()
    keys = tagged >> 1
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    counts = np.add.reduceat(1 - (tagged & 1), starts).astype(np.float32)
    return keys[starts], counts


def _kept_pairs(
    seen: Sequence[tuple[np.ndarray, np.ndarray]], local: Sequence[int], vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts) of rows whose seen tokens the runner keeps: ``local[i] * vocab + id``
    for each of ``seen[i]``'s ids, and their counts."""
    lens = np.fromiter((len(ids) for ids, _ in seen), np.int64, len(seen))
    if int(lens.sum()) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
    ids = np.concatenate([ids for ids, _ in seen])
    assert int(ids.min()) >= 0, "negative token id in a penalty history"
    assert int(ids.max()) < vocab, f"token id >= vocab size {vocab} in a penalty history"
    keys = ids + np.repeat(np.asarray(local, dtype=np.int64) * vocab, lens)
    return keys, np.concatenate([counts for _, counts in seen])


def _row_keys(token_ids: Sequence[Sequence[int]], num_rows: int, vocab: int) -> np.ndarray:
    """``row * vocab + id`` of every id of every row (int64), ids checked in range."""
    lens = np.fromiter(map(len, token_ids), np.int64, num_rows)
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, total)
    assert int(flat.min()) >= 0, "negative token id in a penalty token list"
    assert int(flat.max()) < vocab, f"token id >= vocab size {vocab} in a penalty list"
    flat += np.repeat(np.arange(num_rows, dtype=np.int64) * vocab, lens)
    return flat


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
    (docs/benchmarks.md, "Sampling, penalties")."""
    num_rows, width = logits.shape
    if (
        logits.device.type != "cpu" or logits.dtype != torch.float32
        or num_rows * width < _KEYED_SORT_MIN_ELEMENTS or logits.requires_grad
    ):  # fmt: skip
        return torch.sort(logits, dim=-1, stable=True)
    # numpy throughout: its elementwise passes are ~20% of the whole cheaper than torch's here
    canonical = logits.numpy() + np.float32(0.0)  # a copy, with -0.0 turned into +0.0
    np.copyto(canonical, np.float32(np.nan), where=np.isnan(canonical))
    key = canonical.view(np.int32).astype(np.int64)
    key ^= (key >> 31) & 0x7FFFFFFF  # a negative float's magnitude bits, reversed
    key <<= 32
    key |= np.arange(width, dtype=np.int64)
    key.sort(axis=-1)
    key &= 0xFFFFFFFF
    order = torch.from_numpy(key)
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
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return _top_k_top_p_by_values(logits, top_k, top_p)
    return _top_k_top_p_sorted(logits, top_k, top_p)


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """``apply_top_k_top_p`` with top-p, as vLLM computes it: rows sorted with their order."""
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


def _top_k_top_p_by_values(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """``apply_top_k_top_p``'s top-p on CPU float32 rows, bit for bit, from the sorted values
    alone (numpy's SIMD sort of float32, several times faster than sorting keys that also
    carry the order). Tied tokens have the same probability, so the cumulative sums do not
    depend on how ties are ordered; only which tied tokens fall before the boundary does, and
    the stable order says: the lowest ids. So the first ``b`` sorted positions dropped are
    every token below the value ``v`` at position ``b - 1``, and the first ``b - below(v)``
    tokens (by id) at ``v``."""
    vocab_size = logits.shape[1]
    values = torch.from_numpy(np.sort(logits.numpy(), axis=-1))  # ascending (NaN last)
    masked = values
    if top_k is not None:
        kth = values.gather(1, (vocab_size - top_k)[:, None])  # [R, 1]
        masked = values.masked_fill(values < kth, _NEG_INF)
    cumulative = torch.softmax(masked, dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    num_dropped = drop.sum(dim=-1, keepdim=True)  # [R, 1]: a prefix (the sums only grow)
    last = values.gather(1, (num_dropped - 1).clamp_min_(0))  # the last dropped (none: cuts 0)
    below = torch.searchsorted(values, last)  # [R, 1] tokens strictly below it
    whole = torch.searchsorted(values, last, right=True) == num_dropped  # [R, 1]
    if bool((whole | (num_dropped == 0)).all()):  # no boundary cuts through ties (usual)
        drop_p = (logits <= last) & (num_dropped > 0)
    else:
        at = logits == last
        drop_p = (logits < last) | (at & (at.cumsum(dim=-1) <= num_dropped - below))
    out = logits.masked_fill(drop_p, _NEG_INF)
    if top_k is not None:
        out.masked_fill_(logits < kth, _NEG_INF)
    return out
