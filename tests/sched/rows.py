"""The runner's rows (:class:`SampledToken`) for a step whose tokens a test world made by
sequence: what the scheduler core's update reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from asyncpaged.sampled_token import SampledToken
from asyncpaged.sched.scheduler import SchedulerOutput


def rows_of(
    out: SchedulerOutput,
    sampled: Mapping[int, Sequence[int]],
    tops: Mapping[int, tuple[tuple[int, float], ...]] | None = None,
) -> list[SampledToken]:
    """``sampled[seq_id]``: a speculative row's kept proposals then its token, else one token
    per draw (sample ``i`` the ``i``-th); ``tops[seq_id]``: a beam's best tokens."""
    drafts = {s.seq_id: s.num_draft for s in out.seqs}
    rows = []
    for seq_id, tokens in sampled.items():
        top = (tops or {}).get(seq_id, ())
        if drafts.get(seq_id):
            rows.append(SampledToken(seq_id, tokens[-1], None, None, top, 0, None,
                                     tuple(tokens[:-1])))  # fmt: skip
            continue
        rows.extend(SampledToken(seq_id, t, None, None, top, i) for i, t in enumerate(tokens))
    return rows
