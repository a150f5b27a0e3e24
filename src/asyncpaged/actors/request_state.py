"""The scheduler actor's own record of a live request (:class:`SchedulerRequestState`), never
shared: what the intake fixed, its grammar matchers and the progress the actor reports for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncpaged.actors.messages import RequestInfo
from asyncpaged.actors.thinking_budget import ThinkingBudget
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.sched.scheduler import EngineCoreOutput


@dataclass(slots=True, eq=False)
class SchedulerRequestState:
    """The scheduler actor's own record of a live request (never shared): what the intake
    fixed (``info``), its grammar matchers by completion index (made on its first step), its
    prompt logprobs known so far (position 0 included; None: not asked), the cached-token
    count last reported to the output processor (None: never scheduled yet), the sampling
    options of its completions whose options no longer change from step to step (see
    ``step_builder``), by completion index, and whether its decodes may be planned ahead
    (``ahead``) and then need no late options (``options_ahead``: its options read no output
    token, being fixed or none, penalized with the history kept in the runner, or a grammar's
    whose bitmask alone comes late), and its thinking budget's progress (None: no budget)."""

    info: RequestInfo
    matchers: dict[int, Any] = field(default_factory=dict)
    prompt_known: int | None = None
    reported_cached: int | None = None
    fixed_options: dict[int, SamplingOptions] = field(default_factory=dict)
    # Async scheduling may plan its decodes ahead (no beams; options that read the output
    # come late; with speculative decoding, not where it proposes: ``_plans_ahead``)
    ahead: bool = False
    options_ahead: bool = False
    speculates: bool = False  # a request with num_speculative_tokens
    thinking: ThinkingBudget | None = None  # SamplingParams.thinking_token_budget

    def accept_grammar_tokens(self, index: int, tokens: Sequence[int]) -> bool:
        """Feed completion ``index``'s new tokens to its matcher; False if the grammar refused
        one (the bitmask allowed it, so only a stop token past the end can). An ended grammar
        (its stop token accepted, ``ignore_eos`` going on) is fed nothing more."""
        matcher = self.matchers.get(index)
        if matcher is None:
            return True
        return all(matcher.is_terminated() or matcher.accept_token(t) for t in tokens)

    def grammar_stop(
        self, upd: EngineCoreOutput, eos_token_ids: frozenset[int]
    ) -> tuple[bool, int | None]:
        """(True, stop reason) if a completion's grammar ended on a stop token that did not end
        it: ``min_tokens`` holds stop tokens back, but where the grammar may only end its
        options let them through (``grammar_allows_only``), and the sequence stops there, as
        in vLLM."""
        matcher = self.matchers.get(upd.completion)
        if upd.finish_reason is not None or matcher is None or not upd.new_token_ids:
            return False, None
        if not matcher.is_terminated():
            return False, None
        token = upd.new_token_ids[-1]
        params = self.info.params
        if token in params.stop_token_ids:
            return True, token
        return token in eos_token_ids and not params.ignore_eos, None
