"""SpeculativeStats: totals and acceptance by position."""

from __future__ import annotations

import pytest

from asyncpaged.spec_decode import SpeculativeStats


def test_counts_by_position() -> None:
    stats = SpeculativeStats()
    assert (stats.acceptance_rate, stats.mean_acceptance_length) == (0.0, 0.0)
    stats.observe([3, 3, 0, 2], [3, 1, 0, 0])  # the third sequence proposed nothing
    stats.observe([3], [2])
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 11, 6)
    assert stats.num_proposed_per_position == [4, 4, 3]
    assert stats.num_accepted_per_position == [3, 2, 1]
    assert stats.acceptance_rate_by_position == (0.75, 0.5, 1 / 3)
    assert stats.acceptance_rate == 6 / 11
    assert stats.mean_acceptance_length == 1.0 + 6 / 4
    with pytest.raises(ValueError, match="accepted 4 of 3"):
        stats.observe([3], [4])
