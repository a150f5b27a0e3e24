"""``sample``'s first two stages, row by row: logits -> processed logits -> probabilities.

``process_logits`` (first stage, every row): logit controls (``apply_logit_controls``: allowed
tokens, logit bias, banned tokens, grammar bitmasks, the request's logits processors), the
min-tokens mask and the penalties. ``random_probs`` (second stage, random rows): temperature,
min-p, top-k, top-p, softmax. ``sampler`` draws from the result; speculative decoding calls the
two stages itself to get the very distributions ``sample`` draws from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from asyncpaged.errors import NoTokenAllowedError
from asyncpaged.sampling.logits import (
    apply_min_p,
    apply_min_tokens_mask,
    apply_top_k_top_p,
    penalize_rows_,
)
from asyncpaged.structured_outputs import grammar_mask_bias

if TYPE_CHECKING:
    from asyncpaged.sampling.options import SamplingOptions, SeenTokens

_NEG_INF = float("-inf")


def _process(
    logits: torch.Tensor,
    opts: Sequence[SamplingOptions | None],
    errors: dict[int, BaseException] | None = None,
    penalty_seen: Sequence[SeenTokens | None] | None = None,
) -> torch.Tensor:
    """Logit controls, min-tokens masking and penalties (they change greedy rows too);
    ``logits`` is not edited. ``penalty_seen[i]``: row ``i``'s penalty history kept by the
    runner (required for a row whose options hold only the tail of its output)."""
    masked = [i for i, o in enumerate(opts) if o is not None and o.min_tokens_mask_ids]
    penalized = [i for i, o in enumerate(opts) if o is not None and o.has_penalties]
    controlled = [o is not None and o.has_logit_controls for o in opts]
    if not masked and not penalized and not any(controlled):
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    if any(controlled):
        apply_logit_controls(logits, opts, {} if errors is None else errors)
    apply_min_tokens_mask(logits, [o.min_tokens_mask_ids if o is not None else () for o in opts])
    if penalized:
        subset = [o for o in opts if o is not None and o.has_penalties]
        seen = [None if penalty_seen is None else penalty_seen[i] for i in penalized]
        for o, kept in zip(subset, seen, strict=True):
            assert kept is not None or o.history_seq is None, (
                f"sequence {o.history_seq}: a history kept in the runner, but none given"
            )

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=logits.device)

        penalize_rows_(
            logits,
            penalized,
            prompt_token_ids=[o.prompt_token_ids for o in subset],
            output_token_ids=[o.output_token_ids for o in subset],
            repetition_penalties=column([o.repetition_penalty for o in subset]),
            frequency_penalties=column([o.frequency_penalty for o in subset]),
            presence_penalties=column([o.presence_penalty for o in subset]),
            seen=seen,
        )
    return logits


def apply_logit_controls(
    logits: torch.Tensor,
    opts: Sequence[SamplingOptions | None],
    errors: dict[int, BaseException] | None = None,
) -> None:
    """In place, per row: keep only ``allowed_token_ids``, add ``logit_bias``, ban
    ``banned_token_ids`` and every token ``token_bitmask`` rules out (vLLM v1's order; -inf
    stays -inf under any bias; the masks commute, so the bitmasks go last, in one batch)."""
    device = logits.device
    masked = [r for r, o in enumerate(opts) if o is not None and o.token_bitmask is not None]
    for r, o in enumerate(opts):
        if o is None or not o.has_logit_controls:
            continue
        row = logits[r]
        if o.allowed_token_ids is not None:
            keep = torch.tensor(o.allowed_token_ids, dtype=torch.int64, device=device)
            kept = row[keep].clone()
            row.fill_(_NEG_INF)
            row[keep] = kept
        if o.logit_bias:
            ids = torch.tensor([t for t, _ in o.logit_bias], dtype=torch.int64, device=device)
            bias = torch.tensor([b for _, b in o.logit_bias], dtype=row.dtype, device=device)
            row.index_add_(0, ids, bias)
        if o.banned_token_ids:
            row[torch.tensor(o.banned_token_ids, dtype=torch.int64, device=device)] = _NEG_INF
    if masked:  # structured outputs: each row's grammar allows the set bits of its bitmask
        _apply_bitmasks(logits, masked, [opts[r].token_bitmask for r in masked])  # type: ignore[union-attr]
    for r, o in enumerate(opts):
        if o is not None and o.logits_processors:
            _run_processors(logits, r, o, {} if errors is None else errors)


def _apply_bitmasks(
    logits: torch.Tensor, masked: list[int], bitmasks: list[torch.Tensor | None]
) -> None:
    """-inf in rows ``masked`` of ``logits`` wherever their bitmasks rule a token out: the
    0 / -inf mask bias added (exact where no logit is NaN or +inf: then a ``masked_fill``),
    in place when every row is masked."""
    bias = grammar_mask_bias(bitmasks, logits.shape[1], logits.device)  # [R, V]
    assert bias is not None
    every = len(masked) == logits.shape[0]
    rows = None if every else torch.tensor(masked, dtype=torch.int64, device=logits.device)
    sub = logits if rows is None else logits[rows]
    if bool(sub.amax() < float("inf")):  # amax is NaN if any logit is
        sub.add_(bias)
    else:
        sub.masked_fill_(bias != 0, _NEG_INF)
    if rows is not None:
        logits[rows] = sub


def _run_processors(
    logits: torch.Tensor, r: int, o: SamplingOptions, errors: dict[int, BaseException]
) -> None:
    """Row ``r`` through its request's processors; what one raises is recorded, not raised
    (it fails that request alone), and the row keeps its logits."""
    row = logits[r]
    try:
        for processor in o.logits_processors:
            row = processor(list(o.output_token_ids), row)
            if not (isinstance(row, torch.Tensor) and row.shape == logits[r].shape):
                raise TypeError(
                    f"a logits processor must return a tensor of shape {tuple(logits[r].shape)}"
                )
        logits[r] = row.to(logits.dtype)
    except Exception as exc:  # the user's code: it fails its own request
        errors[r] = exc


def record_ruled_out(
    chosen: torch.Tensor, errors: dict[int, BaseException], rows: Sequence[int] | None = None
) -> None:
    """``chosen`` [R]: the processed logit of each row's chosen token. Where it is -inf no
    token was allowed (a random row draws only tokens of positive probability; a greedy
    row's argmax is -inf only where all are): row ``rows[i]`` (or ``i``) gets a
    :class:`NoTokenAllowedError` in ``errors``, unless it failed already."""
    ruled_out = chosen == _NEG_INF
    if bool(ruled_out.any()):
        for i in torch.nonzero(ruled_out)[:, 0].tolist():
            errors.setdefault(i if rows is None else rows[i], NoTokenAllowedError(
                "every token is ruled out: the request's constraints (structured output, "
                "allowed_token_ids, bad_words, min_tokens) leave none to sample"
            ))  # fmt: skip


def process_logits(
    logits: torch.Tensor,
    opts: Sequence[SamplingOptions | None],
    errors: dict[int, BaseException] | None = None,
) -> torch.Tensor:
    """``sample``'s first stage, for every row: logit controls, min-tokens mask, penalties
    (``logits`` [N, V] is not edited; what a row's logits processor raised goes to ``errors``).
    Greedy rows pick the argmax of the result; random rows go on to :func:`random_probs`."""
    return _process(logits, opts, errors)


def random_probs(logits: torch.Tensor, opts: Sequence[SamplingOptions]) -> torch.Tensor:
    """``sample``'s second stage for random rows: processed logits [R, V] -> the probabilities
    it draws from (temperature, min-p, top-k, top-p, softmax), computed by the same operations."""
    return _random_probs(logits, opts)


def _random_probs(logits: torch.Tensor, opts: Sequence[SamplingOptions]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, softmax: logits [R, V] -> probabilities [R, V]."""
    device, vocab_size = logits.device, logits.shape[1]
    temperature = torch.tensor([o.temperature for o in opts], dtype=torch.float32, device=device)
    logits = logits / temperature[:, None]
    if any(o.min_p > 0.0 for o in opts):
        min_p = torch.tensor([o.min_p for o in opts], dtype=torch.float32, device=device)
        logits = apply_min_p(logits, min_p)
    top_k = None
    if any(0 < o.top_k < vocab_size for o in opts):
        ks = [o.top_k if 0 < o.top_k < vocab_size else vocab_size for o in opts]
        top_k = torch.tensor(ks, dtype=torch.int64, device=device)
    top_p = None
    if any(o.top_p < 1.0 for o in opts):
        top_p = torch.tensor([o.top_p for o in opts], dtype=torch.float32, device=device)
    logits = apply_top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)
