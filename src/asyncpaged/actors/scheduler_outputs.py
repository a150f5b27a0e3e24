"""A step's results on the scheduler actor's side: the sampled tokens grouped per sequence for
:meth:`Scheduler.update`, failed rows (each fails its request alone), structured outputs'
matchers and jump-forward, and prompt-logprob progress. What becomes of them in the requests'
output states is the output processor's (``actors/output_processor.py``); the scheduler actor
decides when each runs (its ``_finish_step`` and ``_deliver``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncpaged._log import LibraryLogger
from asyncpaged.core.scheduler import Scheduler, SchedulerOutput, SeqUpdate
from asyncpaged.errors import NoTokenAllowedError, RequestFailedError
from asyncpaged.messages import RequestInfo
from asyncpaged.model.prompt_logprobs import PromptLogprobRows
from asyncpaged.model.runner import SampledToken
from asyncpaged.model.sampler import SamplingOptions
from asyncpaged.structured_outputs import GrammarBackend

Rows = dict[tuple[int, int], SampledToken]  # (seq id, sample index) -> its sampled token


@dataclass(slots=True, eq=False)
class Tracked:
    """The scheduler actor's own record of a live request (never shared): what the intake
    fixed (``info``), its grammar matchers by completion index (made on its first step), its
    prompt logprobs known so far (position 0 included; None: not asked), the cached-token
    count last reported to the output processor (None: never scheduled yet), the sampling
    options of its completions whose options no longer change from step to step (see
    ``scheduler_steps``), by completion index, and whether its decodes may be planned ahead
    (``ahead``) and then need no late options (``options_ahead``: its options read no output
    token, being fixed or none, penalized with the history kept in the runner, or a grammar's
    whose bitmask alone comes late)."""

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


Tops = dict[int, tuple[tuple[int, float], ...]]


def tokens_by_seq(sampled: Sequence[SampledToken]) -> tuple[Rows, dict[int, Sequence[int]], Tops]:
    """The step's rows by (seq id, sample index); each sequence's new tokens, in row order
    (speculative: the kept proposals, then the target's token); each sequence's first row's
    top logprobs."""
    by_row: Rows = {}
    tokens: dict[int, Sequence[int]] = {}
    top: Tops = {}
    for t in sampled:  # the common step: a row per sequence, one token each, in one pass
        if t.sample_index or t.accepted:
            return _tokens_by_seq(sampled)
        by_row[(t.seq_id, 0)] = t
        tokens[t.seq_id] = (t.token_id,)
        top[t.seq_id] = t.top_logprobs
    return by_row, tokens, top


def _tokens_by_seq(sampled: Sequence[SampledToken]) -> tuple[Rows, dict[int, Sequence[int]], Tops]:
    """:func:`tokens_by_seq` for steps with fan-out or speculative rows."""
    by_row = {(t.seq_id, t.sample_index): t for t in sampled}
    # Fan-out rows in sample-index order per sequence (others: one row per sequence).
    fanned = any(index for _, index in by_row)
    rows: Iterable[tuple[tuple[int, int], SampledToken]] = (
        sorted(by_row.items()) if fanned else by_row.items()
    )
    tokens: dict[int, list[int]] = {}
    for (seq_id, _), t in rows:
        if t.accepted:  # speculative: the kept proposals, then the target's token
            tokens[seq_id] = [*t.accepted, t.token_id]
        else:
            tokens.setdefault(seq_id, []).append(t.token_id)
    top = {t.seq_id: t.top_logprobs for t in by_row.values() if t.sample_index == 0}
    return by_row, dict(tokens), top


def failed_requests(
    out: SchedulerOutput, failed: list[SampledToken], scheduler: Scheduler, log: LibraryLogger
) -> list[tuple[str, RequestFailedError]]:
    """Rows whose logits processor raised, or whose constraints allowed no token: each such
    request is aborted in the core (its blocks are freed by the next transaction) and fails
    alone; returns them with the error their waiters get."""
    if not failed:
        return []
    owner = {s.seq_id: s.request_id for s in out.seqs}
    ended = []
    for token in failed:
        rid = owner[token.seq_id]
        if scheduler.abort(rid) is None:
            continue  # another row of it failed first
        why = (
            "its constraints allowed no token"
            if isinstance(token.error, NoTokenAllowedError)
            else "its logits processor raised"
        )
        error = RequestFailedError(f"request {rid!r}: {why}")
        error.__cause__ = token.error
        ended.append((rid, error))
        log.info("request_failed", request_id=rid, error=repr(token.error))
    return ended


def prompt_logprob_progress(
    out: SchedulerOutput,
    rows: tuple[PromptLogprobRows, ...],
    scheduler: Scheduler,
    tracked: dict[str, Tracked],
) -> list[tuple[str, PromptLogprobRows]]:
    """The step's prompt logprobs by request (for the output processor), counted into each
    request's ``prompt_known``; a request whose prompt logprobs are complete reads the prefix
    cache again."""
    if not rows:
        return []
    owner = {s.seq_id: s.request_id for s in out.seqs}
    by_request = []
    for chunk in rows:
        rid = owner[chunk.seq_id]
        t = tracked.get(rid)
        if t is None or t.prompt_known is None:
            continue  # aborted or failed meanwhile
        by_request.append((rid, chunk))
        t.prompt_known = max(t.prompt_known, chunk.first_position + len(chunk.token_ids))
        request = scheduler.requests.get(rid)
        if t.prompt_known >= len(t.info.prompt_token_ids) and request is not None:
            request.read_prefix_cache = True
    return by_request


def prompt_logprob_targets(
    known: int | None, prompt: Sequence[int], start: int, num_new: int
) -> tuple[int, tuple[int, ...]]:
    """(row offset, prompt tokens they predict) for a step computing positions ``start ..
    start + num_new - 1`` of a request with ``known`` prompt logprobs (None: not asked): the
    rows whose prompt logprob is still unknown ((0, ()): none; a prefill recomputed after
    preemption skips the positions already known)."""
    if known is None:
        return 0, ()
    first = max(start, known - 1)
    end = min(start + num_new, len(prompt) - 1)
    if first >= end:
        return 0, ()
    return first - start, tuple(prompt[first + 1 : end + 1])


def accept_grammar_tokens(matchers: dict[int, Any], index: int, tokens: Sequence[int]) -> bool:
    """Feed a completion's new tokens to its matcher; False if the grammar refused one
    (the bitmask allowed it, so only a stop token past the end can). An ended grammar
    (its stop token accepted, ``ignore_eos`` going on) is fed nothing more."""
    matcher = matchers.get(index)
    if matcher is None:
        return True
    return all(matcher.is_terminated() or matcher.accept_token(t) for t in tokens)


def grammar_stop(
    info: RequestInfo, matchers: dict[int, Any], upd: SeqUpdate, eos_token_ids: frozenset[int]
) -> tuple[bool, int | None]:
    """(True, stop reason) if a completion's grammar ended on a stop token that did not end
    it: ``min_tokens`` holds stop tokens back, but where the grammar may only end its options
    let them through (``grammar_allows_only``), and the sequence stops there, as in vLLM."""
    matcher = matchers.get(upd.completion)
    if upd.finish_reason is not None or matcher is None or not upd.new_token_ids:
        return False, None
    if not matcher.is_terminated():
        return False, None
    token = upd.new_token_ids[-1]
    params = info.params
    if token in params.stop_token_ids:
        return True, token
    return token in eos_token_ids and not params.ignore_eos, None


def jump_forward(
    info: RequestInfo,
    matchers: dict[int, Any],
    upd: SeqUpdate,
    scheduler: Scheduler,
    grammars: GrammarBackend | None,
) -> tuple[SeqUpdate, int]:
    """Structured outputs' jump-forward: after a sampled token, append the tokens the
    grammar forces next (``EngineConfig.structured_outputs_jump_forward``); the next step
    computes them as a chunk. Not for requests that report logprobs (a forced token's
    logprob is never computed) or rank by them (best_of). Returns the update with them and
    their number."""
    matcher = matchers.get(upd.completion)
    if (
        matcher is None or grammars is None or not grammars.jump_forward
        or upd.finish_reason is not None or info.params.logprobs is not None
        or info.ranks_by_logprob
    ):  # fmt: skip
        return upd, 0
    forced = grammars.jump_forward_tokens(matcher)
    if not forced:
        return upd, 0
    appended, reason, stop = scheduler.append_forced(upd.request_id, upd.seq_id, forced)
    return upd._replace(new_token_ids=upd.new_token_ids + appended,
                        finish_reason=reason, stop_reason=stop), len(appended)  # fmt: skip
