"""Counters of speculative decoding: proposed and accepted tokens, by position."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class SpeculativeStats:
    """Totals over verification rounds (vLLM's ``SpecDecodingStats`` vocabulary).

    Invariants: ``num_accepted_tokens <= num_draft_tokens``; ``num_proposed_per_position[j]``
    counts the rounds that proposed at least ``j + 1`` tokens and
    ``num_accepted_per_position[j] <= num_proposed_per_position[j]``, both non-increasing in
    ``j``; the per-position lists sum to the totals. A round that proposed nothing (no n-gram
    match) is not a draft: it counts nowhere.
    """

    num_drafts: int = 0  # verification rounds with at least one proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_proposed_per_position: list[int] = field(default_factory=list)
    num_accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Add one step's rounds: per sequence, proposals made and proposals accepted."""
        for k, a in zip(num_draft_tokens, num_accepted, strict=True):
            if not 0 <= a <= k:
                raise ValueError(f"accepted {a} of {k} proposals.")
            if k == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            grow = k - len(self.num_proposed_per_position)
            if grow > 0:
                self.num_proposed_per_position.extend([0] * grow)
                self.num_accepted_per_position.extend([0] * grow)
            for j in range(k):
                self.num_proposed_per_position[j] += 1
            for j in range(a):
                self.num_accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted share of the proposed tokens (0.0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_by_position(self) -> tuple[float, ...]:
        """Per position ``j``: the share of the rounds proposing ``j + 1`` or more tokens whose
        first ``j + 1`` proposals were all accepted."""
        return tuple(
            a / n
            for a, n in zip(
                self.num_accepted_per_position, self.num_proposed_per_position, strict=True
            )
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per round with proposals: accepted ones plus the target's (1.0 at
        worst, ``k + 1`` at best)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
