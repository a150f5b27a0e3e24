"""``SamplingParams.thinking_token_budget``: where a request's completions are in their
thinking, token by token, and when the end marker is due (:class:`ThinkingBudget`).

How the end is forced: the scheduler actor appends the end marker's token ids to the sequence
after the token that spends the budget (``Scheduler.append_forced``, structured outputs'
jump-forward path): they are output tokens like any other (streamed, detokenized, counted
toward ``max_tokens``), computed by the next step as a chunk, and the model samples its
answer after them. A budget of 0 on a prompt that opened the thinking needs the marker before
any token is sampled: it is appended to the new sequence when the request is added, and
reported with its first sampled token (not for ``n``/``best_of`` > 1, whose sequences the core
forks from the prompt alone: there the first sampled token spends the budget and the marker
follows it; also where the marker does not fit in ``max_tokens`` or one of its ids would stop
the sequence).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncpaged.reasoning import ReasoningMarkers

__all__ = ["ThinkingBudget"]


class _Phase(enum.Enum):
    LEAD = "lead"  # the reply may still open its thinking with the start marker
    THINKING = "thinking"
    DONE = "done"  # the thinking ended (closed, or forced closed), or never opened


@dataclass(slots=True)
class _Progress:
    """One completion's place: its phase, tokens generated, tokens spent thinking, and the
    last tokens it generated (as many as the longer marker has)."""

    phase: _Phase
    num_generated: int = 0
    num_thinking: int = 0
    tail: list[int] = field(default_factory=list)


class ThinkingBudget:
    """One request's thinking budget, per completion (the forks of ``n > 1`` think apart).

    A completion thinks from its first token when the reply starts inside the thinking (the
    parser's ``reply_starts_in_reasoning`` of whether the prompt opened it), else from the
    token after a start marker that its first tokens spell; its thinking ends with the first
    end marker its tokens spell. Once it has generated ``budget`` tokens thinking, the end
    marker's ids are due (:meth:`forced_after`), once. The markers are matched as token ids:
    an end marker the model writes with other tokens than ``end_ids`` is not seen.
    """

    def __init__(
        self, markers: ReasoningMarkers, budget: int, *, in_reasoning: bool, can_lead: bool
    ) -> None:
        """``can_lead``: the end marker may go in before any token is sampled (module
        docstring); else a budget of 0 inside the thinking is spent by the first sampled
        token, and the marker follows it."""
        self.markers = markers
        self.budget = budget
        inside = markers.parser.reply_starts_in_reasoning(in_reasoning)
        leads = inside and budget == 0 and can_lead
        self.forced_first: tuple[int, ...] = markers.end_ids if leads else ()
        """What every completion starts with, before its first sampled token: the end marker
        for a budget of 0 inside the thinking, else nothing."""
        self._first = (
            _Phase.DONE if leads else _Phase.THINKING if inside else _Phase.LEAD
        )  # fmt: skip
        self._progress: dict[int, _Progress] = {}
        self._reported: set[int] = set()  # completions whose first tokens were reported

    def reported_prefix(self, completion: int) -> tuple[int, ...]:
        """``forced_first``, the first time a completion's tokens are reported (they go before
        its first sampled token), then ()."""
        if completion in self._reported:
            return ()
        self._reported.add(completion)
        return self.forced_first

    def forced_after(self, completion: int, new_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Completion ``completion``'s new tokens (all it generated since the last call, its
        ``forced_first`` not included): the end marker's ids if they are due now, else ()."""
        progress = self._progress.get(completion)
        if progress is None:
            progress = self._progress[completion] = _Progress(self._first)
        if progress.phase is _Phase.DONE:
            return ()
        start, end = self.markers.start_ids, self.markers.end_ids
        keep = max(len(start), len(end))
        for token in new_token_ids:
            progress.num_generated += 1
            progress.tail.append(token)
            del progress.tail[:-keep]
            if progress.phase is _Phase.LEAD:
                n = progress.num_generated
                if token != start[n - 1]:
                    progress.phase = _Phase.DONE  # the reply did not open a thinking block
                    return ()
                if n == len(start):
                    progress.phase = _Phase.THINKING
                continue
            progress.num_thinking += 1
            if progress.tail[-len(end) :] == list(end):
                progress.phase = _Phase.DONE
                return ()
        if progress.phase is _Phase.THINKING and progress.num_thinking >= self.budget:
            progress.phase = _Phase.DONE
            return end
        return ()
