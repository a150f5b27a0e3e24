"""Verification of speculative proposals: which to keep, and the target's next token.

The target model scores a sequence's ``k`` proposals ``x_0..x_{k-1}`` in one forward of
``k + 1`` query tokens (the last accepted token, then the proposals); its logits row ``j`` is
the target's distribution ``p_j`` for the token after ``context + x_0..x_{j-1}``::

    query tokens  t      x_0    x_1   ...  x_{k-1}
    logits row    p_0    p_1    p_2   ...  p_k          (row k: the bonus position)
    verdict       x_0?   x_1?   x_2?  ...  (all k kept: one more token from p_k)

Per sequence the output is ``x_0..x_{a-1}`` (the ``a`` accepted proposals) and one token of
the target's: its own choice at the first rejected position, or the bonus token after all ``k``
were accepted. So 1 to ``k + 1`` tokens, and the output distribution is exactly the target's
(Leviathan et al. 2023, Chen et al. 2023):

* greedy rows: ``x_j`` is accepted while it equals the target's argmax at ``j``; the output is
  token for token that of non-speculative greedy decoding.
* random rows, one-hot drafts (ngram, ``draft_probs=None``): accept ``x_j`` with probability
  ``p_j(x_j)``, else draw from ``p_j`` without ``x_j`` (the residual ``max(p - q, 0)`` for a
  one-hot ``q``). Drawn as a coupling: the target's own token ``y_j`` is drawn exactly as
  ``sample`` draws it (same processing, same per-position random stream) and ``x_j`` is
  accepted iff ``y_j == x_j``; on a mismatch ``y_j`` is the output. ``P(accept) = p(x)`` and
  ``y | y != x`` follows the residual, so this *is* the modified rejection sampling, and a
  seeded sequence draws the very tokens non-speculative decoding draws.
* random rows, draft distributions ``q`` (draft model): accept ``x_j`` iff ``u * q_j(x_j) <
  p_j(x_j)`` with ``u ~ U[0, 1)``; at the first rejection draw from ``max(p_j - q_j, 0)``
  normalised (``p_j`` if that is all zero, which has probability 0); the bonus token is drawn
  from ``p_k`` as ``sample`` would.

``p_j`` is the distribution ``sample`` draws from: ``sampler.process_logits`` (logit controls,
min-tokens mask, penalties) then ``sampler.random_probs`` (temperature, min-p, top-k, top-p).
Seeded rows are reproducible: all their randomness comes from the row's ``generator_key``
(salted with ``salt_generator_key`` for the acceptance test and the residual draw), so the same
seed gives the same tokens whatever the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asyncpaged.sampling.options import SamplingOptions, salt_generator_key
from asyncpaged.sampling.sampler import (
    draw_tokens,
    greedy,
    process_logits,
    random_probs,
    row_uniforms,
)
from asyncpaged.sampling.stages import record_ruled_out

ACCEPT_SALT = 0x5EC_ACCE97
"""Salt of the generator key for the acceptance test's uniform (draft-model rows)."""
RESIDUAL_SALT = 0x5EC_2E51D
"""Salt of the generator key for the draw from the residual distribution (draft-model rows)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOutput:
    """What :func:`verify` decided, per sequence ``i``.

    ``token_ids[i]`` holds ``num_accepted[i] + 1`` tokens: the accepted proposals, then the
    target's token. ``row_indices`` [sum(len(token_ids[i]))] int64 are the target-logits rows
    the emitted tokens were scored at, in order (for their logprobs: ``log_softmax`` of those
    raw rows, as ``sample`` computes them). ``errors[i]``: what sequence ``i``'s logits
    processor raised (its tokens are then meaningless; fail that request alone).
    """

    num_accepted: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]
    row_indices: torch.Tensor
    errors: Mapping[int, BaseException] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each sequence's rows are: target rows ``offsets[i] .. offsets[i] + k_i``, draft
    rows ``draft_offsets[i] .. + k_i``; for each flat draft position its sequence and target
    row."""

    num_draft: list[int]
    offsets: list[int]
    draft_offsets: list[int]
    target_rows: list[int]  # [D]: the target row scoring each flat proposal
    draft_seq: torch.Tensor  # [D] int64
    draft_target_row: torch.Tensor  # [D] int64
    draft_tokens: torch.Tensor  # [D] int64


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    options: Sequence[SamplingOptions | None],
    *,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> VerifyOutput:
    """Accept or reject each sequence's proposals against the target's logits.

    ``target_logits`` [T, V] float32 with ``T = sum(k_i + 1)``: sequence ``i``'s ``k_i + 1``
    rows are consecutive, in sequence order (``k_i = len(draft_token_ids[i])``, may be 0).
    ``options`` has one entry per target row: row ``j`` of a sequence gets the options the
    engine would build for that sequence's context extended by ``x_0..x_{j-1}`` (penalty
    history, min-tokens mask, bad-words bans, and the generator key of position
    ``num_generated + j``); None = plain greedy. A sequence's rows must agree on greediness.
    ``draft_probs`` [sum(k_i), V] float32: the distributions the proposals were drawn from, one
    row per proposal in the same flat order (rows of greedy sequences are not read); None for
    one-hot proposals (ngram). ``generator`` draws for unseeded random rows.
    """
    assert target_logits.dtype == torch.float32, f"float32 logits, got {target_logits.dtype}"
    layout = _layout(draft_token_ids, target_logits.shape[0], target_logits.device)
    assert len(options) == target_logits.shape[0], "one SamplingOptions per target row"
    if draft_probs is not None:
        assert draft_probs.shape == (len(layout.draft_tokens), target_logits.shape[1]), (
            f"draft_probs {tuple(draft_probs.shape)} for {len(layout.draft_tokens)} proposals"
        )
    is_random = _random_rows(options, layout)
    row_errors: dict[int, BaseException] = {}
    processed = process_logits(target_logits, options, row_errors)  # [T, V]
    device = target_logits.device
    chosen = torch.empty(target_logits.shape[0], dtype=torch.int64, device=device)
    greedy_rows = [r for r, rnd in enumerate(is_random) if not rnd]
    random_rows = [r for r, rnd in enumerate(is_random) if rnd]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, dtype=torch.int64, device=device)
        chosen[rows] = greedy(processed[rows])
    probs: torch.Tensor | None = None  # [R, V] for the random rows, in random_rows order
    random_opts = [_not_none(options[r]) for r in random_rows]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.int64, device=device)
        probs = random_probs(processed[rows], random_opts)
        if draft_probs is None:  # the coupling: the target's own draw at every position
            chosen[rows] = draw_tokens(probs, random_opts, generator)
    accepted = chosen[layout.draft_target_row] == layout.draft_tokens  # [D]
    if draft_probs is not None and probs is not None:
        _accept_drafted(accepted, probs, draft_probs, random_rows, options, layout, generator)
    num_accepted = _num_accepted(accepted, layout)
    last_rows = [off + a for off, a in zip(layout.offsets, num_accepted, strict=True)]
    if draft_probs is not None and probs is not None:
        _draw_last_tokens(chosen, last_rows, num_accepted, probs, draft_probs, random_rows,
                          options, layout, generator)  # fmt: skip
    last = chosen[torch.tensor(last_rows, dtype=torch.int64, device=device)].tolist()
    token_ids = tuple(
        (*draft[:a], tok) for draft, a, tok in zip(draft_token_ids, num_accepted, last, strict=True)
    )
    row_indices = [off + j for off, a in zip(layout.offsets, num_accepted, strict=True)
                   for j in range(a + 1)]  # fmt: skip
    if processed is not target_logits:  # the tokens kept (proposals, then the last), none ruled out
        kept = torch.tensor(row_indices, dtype=torch.int64, device=device)
        tokens = torch.tensor([t for kept_ids in token_ids for t in kept_ids], device=device)
        record_ruled_out(processed[kept, tokens], row_errors, row_indices)
    errors: dict[int, BaseException] = {}
    for r in sorted(row_errors):
        errors.setdefault(_seq_of_row(r, layout), row_errors[r])
    return VerifyOutput(
        num_accepted=tuple(num_accepted),
        token_ids=token_ids,
        row_indices=torch.tensor(row_indices, dtype=torch.int64, device=device),
        errors=errors,
    )


def _layout(
    draft_token_ids: Sequence[Sequence[int]], num_rows: int, device: torch.device
) -> _Layout:
    num_draft = [len(d) for d in draft_token_ids]
    offsets, draft_offsets, row, drow = [], [], 0, 0
    for k in num_draft:
        offsets.append(row)
        draft_offsets.append(drow)
        row += k + 1
        drow += k
    assert row == num_rows, f"{num_rows} target rows for {len(num_draft)} sequences, {row} needed"
    seq = [i for i, k in enumerate(num_draft) for _ in range(k)]
    target_row = [offsets[i] + j for i, k in enumerate(num_draft) for j in range(k)]
    tokens = [t for d in draft_token_ids for t in d]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return _Layout(num_draft, offsets, draft_offsets, target_row, tensor(seq),
                   tensor(target_row), tensor(tokens))  # fmt: skip


def _random_rows(options: Sequence[SamplingOptions | None], layout: _Layout) -> list[bool]:
    is_random = [o is not None and not o.is_greedy for o in options]
    for off, k in zip(layout.offsets, layout.num_draft, strict=True):
        assert len(set(is_random[off : off + k + 1])) == 1, (
            f"the rows {off}..{off + k} of one sequence disagree on greedy sampling"
        )
    return is_random


def _not_none(option: SamplingOptions | None) -> SamplingOptions:
    assert option is not None
    return option


def _seq_of_row(row: int, layout: _Layout) -> int:
    for i, (off, k) in enumerate(zip(layout.offsets, layout.num_draft, strict=True)):
        if off <= row <= off + k:
            return i
    raise AssertionError(f"row {row} outside every sequence")


def _num_accepted(accepted: torch.Tensor, layout: _Layout) -> list[int]:
    """Per sequence, the length of the all-accepted prefix of its proposals."""
    num_seqs, width = len(layout.num_draft), max(layout.num_draft, default=0)
    if width == 0:
        return [0] * num_seqs
    padded = torch.ones(num_seqs, width, dtype=torch.int64, device=accepted.device)
    positions = (
        layout.draft_target_row
        - torch.tensor(layout.offsets, dtype=torch.int64, device=accepted.device)[layout.draft_seq]
    )
    padded[layout.draft_seq, positions] = accepted.to(torch.int64)
    run = torch.cumprod(padded, dim=1).sum(dim=1).tolist()  # padding counts past a full run
    return [min(a, k) for a, k in zip(run, layout.num_draft, strict=True)]


def _accept_drafted(
    accepted: torch.Tensor,
    probs: torch.Tensor,
    draft_probs: torch.Tensor,
    random_rows: list[int],
    options: Sequence[SamplingOptions | None],
    layout: _Layout,
    generator: torch.Generator | None,
) -> None:
    """In place: the acceptance test ``u * q(x) < p(x)`` at the random rows' proposals."""
    index_in_probs = {r: i for i, r in enumerate(random_rows)}
    drafts = [d for d, r in enumerate(layout.target_rows) if r in index_in_probs]
    if not drafts:
        return
    device = probs.device
    d_index = torch.tensor(drafts, dtype=torch.int64, device=device)
    rows = [layout.target_rows[d] for d in drafts]
    p_rows = torch.tensor([index_in_probs[r] for r in rows], dtype=torch.int64, device=device)
    x = layout.draft_tokens[d_index][:, None]
    p_x = probs[p_rows].gather(1, x)[:, 0].double()
    q_x = draft_probs[d_index].gather(1, x)[:, 0].double()
    opts = [_not_none(options[r]) for r in rows]
    u = row_uniforms(_salted(opts, ACCEPT_SALT), device, generator)
    accepted[d_index] = u * q_x < p_x


def _draw_last_tokens(
    chosen: torch.Tensor,
    last_rows: list[int],
    num_accepted: list[int],
    probs: torch.Tensor,
    draft_probs: torch.Tensor,
    random_rows: list[int],
    options: Sequence[SamplingOptions | None],
    layout: _Layout,
    generator: torch.Generator | None,
) -> None:
    """In place, for random sequences with draft distributions: the token at each one's last
    row, from the residual at its first rejection or from ``p_k`` (the bonus position)."""
    index_in_probs = {r: i for i, r in enumerate(random_rows)}
    bonus: list[int] = []
    residual: list[tuple[int, int]] = []  # (target row, draft row)
    for i, row in enumerate(last_rows):
        if row not in index_in_probs:
            continue
        if num_accepted[i] == layout.num_draft[i]:
            bonus.append(row)
        else:
            residual.append((row, layout.draft_offsets[i] + num_accepted[i]))
    device = probs.device
    if bonus:
        p_idx = torch.tensor([index_in_probs[r] for r in bonus], dtype=torch.int64, device=device)
        chosen[torch.tensor(bonus, dtype=torch.int64, device=device)] = draw_tokens(
            probs[p_idx], [_not_none(options[r]) for r in bonus], generator
        )
    if residual:
        rows = [r for r, _ in residual]
        p_idx = torch.tensor([index_in_probs[r] for r in rows], dtype=torch.int64, device=device)
        q_idx = torch.tensor([d for _, d in residual], dtype=torch.int64, device=device)
        chosen[torch.tensor(rows, dtype=torch.int64, device=device)] = _draw_residual(
            probs[p_idx], draft_probs[q_idx], [_not_none(options[r]) for r in rows], generator
        )


def _draw_residual(
    p: torch.Tensor,
    q: torch.Tensor,
    opts: Sequence[SamplingOptions],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row from ``max(p - q, 0)`` normalised (``p`` where that is all zero)."""
    residual = (p - q).clamp_min_(0.0)  # [R, V]
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
    return draw_tokens(residual, _salted(opts, RESIDUAL_SALT), generator)


def _salted(opts: Sequence[SamplingOptions], salt: int) -> list[SamplingOptions]:
    """The options with each seeded row's generator key salted (another draw at the same
    position, independent of ``sample``'s); unseeded rows as they are."""
    return [
        dataclasses.replace(o, generator_key=salt_generator_key(o.generator_key, salt))
        if o.seed is not None
        else o
        for o in opts
    ]
