"""``ThinkingBudget`` alone: when the end marker is due, for replies inside the thinking and
replies that open it with a (multi-token) start marker, per completion."""

from __future__ import annotations

from asyncpaged.actors.thinking_budget import ThinkingBudget
from asyncpaged.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningMarkers

QWEN = ReasoningMarkers(parser=Qwen3ReasoningParser, start_ids=(7, 8), end_ids=(9, 10))
R1 = ReasoningMarkers(parser=DeepSeekR1ReasoningParser, start_ids=(7, 8), end_ids=(9, 10))


def feed(budget: ThinkingBudget, tokens: list[int], completion: int = 0) -> list[int]:
    """The tokens fed one by one, with what the budget forced after each."""
    out: list[int] = []
    for t in tokens:
        out += [t, *budget.forced_after(completion, (t,))]
    return out


def test_inside_the_thinking_counts_from_the_first_token() -> None:
    budget = ThinkingBudget(QWEN, 3, in_reasoning=True, can_lead=True)
    assert budget.forced_first == ()
    assert feed(budget, [1, 2, 3, 4, 5]) == [1, 2, 3, 9, 10, 4, 5]
    # each completion on its own
    assert feed(budget, [1, 9, 10, 4, 5, 6], completion=1) == [1, 9, 10, 4, 5, 6]


def test_a_leading_start_marker_opens_it() -> None:
    budget = ThinkingBudget(QWEN, 2, in_reasoning=False, can_lead=True)
    assert feed(budget, [7, 8, 1, 2, 3]) == [7, 8, 1, 2, 9, 10, 3]
    assert feed(budget, [1, 7, 8, 2, 3, 4], completion=1) == [1, 7, 8, 2, 3, 4]  # not leading
    zero = ThinkingBudget(QWEN, 0, in_reasoning=False, can_lead=True)
    assert zero.forced_first == ()
    assert feed(zero, [7, 8, 1]) == [7, 8, 9, 10, 1]
    assert zero.forced_after(0, (1, 2)) == ()  # once


def test_budget_zero_inside_goes_first_where_it_can() -> None:
    zero = ThinkingBudget(R1, 0, in_reasoning=False, can_lead=True)  # R1: always inside
    assert zero.forced_first == (9, 10)
    assert (zero.reported_prefix(0), zero.reported_prefix(0)) == ((9, 10), ())
    assert zero.reported_prefix(1) == (9, 10)
    assert feed(zero, [1, 2]) == [1, 2]
    late = ThinkingBudget(R1, 0, in_reasoning=True, can_lead=False)
    assert late.forced_first == () and late.reported_prefix(0) == ()
    assert feed(late, [1, 2]) == [1, 9, 10, 2]


def test_a_multi_token_update_closing_itself_is_left_alone() -> None:
    budget = ThinkingBudget(QWEN, 2, in_reasoning=True, can_lead=True)
    assert budget.forced_after(0, (1, 2, 9, 10, 3)) == ()
    assert budget.forced_after(1, (1, 2, 3)) == (9, 10)
