"""Token selection from float32 logits. This increment: greedy only (+ the sampled token's logprob).

Grows into the full sampler (temperature, top-k/p, penalties, seeded generators) behind
``sample(logits, params)``; callers already pass per-row requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32, log-softmax of the chosen token; None if unasked


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32 -> [N] int64 argmax; ties go to the lowest token id."""
    # torch.argmax returns the first maximal index, i.e. the lowest id among ties.
    return torch.argmax(logits, dim=-1)


def sample(logits: torch.Tensor, *, want_logprobs: bool) -> SamplerOutput:
    """Greedy sampling over logits [N, V] (float32); logprobs of the chosen tokens if asked."""
    assert logits.dtype == torch.float32, f"sampler expects float32 logits, got {logits.dtype}"
    token_ids = greedy(logits)
    logprobs = None
    if want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None])[:, 0]
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
