"""The scheduler actor's side of draft-model speculation: the proposals the runner's draft
(``worker/draft.py``) drew at the end of the last step, handed to the core's proposer while the
sequence's context still ends where the draft began."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncpaged.sched.scheduler import ScheduledSeq
    from asyncpaged.worker.protocol import SampledToken


class DraftProposals:
    """The scheduler actor's side: the last step's proposals per sequence, with the context
    length and last token they follow."""

    def __init__(self) -> None:
        self._by_seq: dict[int, tuple[int, int, tuple[int, ...]]] = {}

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> tuple[int, ...]:
        """The core's proposer: the stored proposals if ``token_ids`` still ends where the
        draft began, else none."""
        entry = self._by_seq.get(seq_id)
        if entry is None:
            return ()
        length, last, proposals = entry
        if len(token_ids) != length or token_ids[-1] != last:
            return ()
        return proposals[:k]

    def record(self, seqs: Iterable[ScheduledSeq], sampled: Iterable[SampledToken]) -> None:
        """A step's results replace the stored proposals (a sequence that proposed nothing
        this step proposes nothing next step)."""
        by_id = {s.seq_id: s for s in seqs}
        self._by_seq = {}
        for t in sampled:
            s = by_id.get(t.seq_id)
            if not t.proposals or s is None:
                continue
            length = s.start_pos + len(s.token_ids) - s.num_draft + len(t.accepted) + 1
            self._by_seq[t.seq_id] = (length, t.token_id, t.proposals)

    def __len__(self) -> int:
        return len(self._by_seq)
