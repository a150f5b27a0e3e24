"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): the full fp32 LM head over the
prompt rows of a step that ask for them.

A prefill chunk of a sequence covers positions ``start .. start + n - 1``; the row of position
``p`` predicts the prompt token at ``p + 1``, so a chunk that stops short of the prompt's end
needs the next chunk's first token as its last row's target::

    prompt:   t0  t1  t2  t3 | t4  t5  t6         (chunks of 4 and 3)
    rows:     r0  r1  r2  r3 | r4  r5  r6
    targets:  t1  t2  t3  t4 | t5  t6  --         (r6 samples the first output token)

The scheduler sends, per sequence, the targets of a run of rows (``SequenceStep.prompt_targets``
from row ``prompt_row_offset``); only those rows take the head, in slices of about
``SLICE_ELEMENTS`` logits each (a long prompt's ``[rows, V]`` never exists at once). Steps
without such rows do nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from asyncpaged.worker.protocol import PromptLogprobRows

if TYPE_CHECKING:
    from asyncpaged.model.base import CausalLM
    from asyncpaged.worker.protocol import SequenceStep

SLICE_ELEMENTS = 1 << 24
"""fp32 logits held at once (64 MiB, twice that with their log-softmax): 512 rows of a 32k
vocabulary, 64 of a 256k one."""


def compute_prompt_logprobs(
    model: CausalLM,
    hidden: torch.Tensor,
    seqs: Sequence[SequenceStep],
    query_start_loc: Sequence[int],
) -> tuple[PromptLogprobRows, ...]:
    """hidden [T, H] of a step's flat batch (sequence ``i`` at rows ``query_start_loc[i]..``)
    -> the prompt logprobs its sequences asked for, in plan order (raw log-softmax of the fp32
    head: no logit controls, penalties or temperature)."""
    asked = [(i, s) for i, s in enumerate(seqs) if s.prompt_targets]
    if not asked:
        return ()
    rows: list[int] = []
    targets: list[int] = []
    for i, seq in asked:
        first = query_start_loc[i] + seq.prompt_row_offset
        rows.extend(range(first, first + len(seq.prompt_targets)))
        targets.extend(seq.prompt_targets)
    device = hidden.device
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    target_ids = torch.tensor(targets, dtype=torch.int64, device=device)
    num_top = max(s.num_prompt_logprobs for _, s in asked)
    rows_per_slice = max(16, SLICE_ELEMENTS // model.vocab_rows())
    parts: list[tuple[torch.Tensor, ...]] = []
    for begin in range(0, len(rows), rows_per_slice):
        end = min(begin + rows_per_slice, len(rows))
        parts.append(_slice_logprobs(model, hidden[row_index[begin:end]], target_ids[begin:end],
                                     num_top))  # fmt: skip
    chosen = torch.cat([p[0] for p in parts]).tolist()
    ranks = torch.cat([p[1] for p in parts]).tolist()
    top_lps = torch.cat([p[2] for p in parts]).tolist() if num_top else None
    top_ids = torch.cat([p[3] for p in parts]).tolist() if num_top else None
    out: list[PromptLogprobRows] = []
    begin = 0
    for _, seq in asked:
        end = begin + len(seq.prompt_targets)
        k = seq.num_prompt_logprobs
        top: tuple[tuple[tuple[int, float], ...], ...] = ((),) * (end - begin)
        if k and top_ids is not None and top_lps is not None:
            top = tuple(
                tuple(zip(top_ids[r][:k], top_lps[r][:k], strict=True)) for r in range(begin, end)
            )
        out.append(
            PromptLogprobRows(
                seq_id=seq.seq_id,
                first_position=seq.num_computed_tokens + seq.prompt_row_offset + 1,
                token_ids=seq.prompt_targets,
                logprobs=tuple(chosen[begin:end]),
                ranks=tuple(ranks[begin:end]),
                top=top,
            )
        )
        begin = end
    return tuple(out)


def _slice_logprobs(
    model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, ...]:
    """(target logprob [R], rank [R], top logprobs [R, k], top ids [R, k]) of R rows."""
    logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)  # [R, V] float32
    chosen = logprobs.gather(1, targets[:, None])  # [R, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [R]: as the sampler ranks sampled tokens
    if not num_top:
        return chosen[:, 0], ranks
    top_logprobs, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    return chosen[:, 0], ranks, top_logprobs, top_ids
