"""A step's results, recorded into the core and the requests' states: the sampled tokens
grouped per sequence for :meth:`Scheduler.update`, failed rows (each fails its request alone),
structured outputs' matchers and jump-forward, prompt logprobs, and each completion's new
tokens (detokenizing, logprobs, stop strings). The scheduler actor decides when each runs (see
its ``_finish_step`` and ``_deliver``) and who is woken."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from asyncpaged._log import LibraryLogger
from asyncpaged.core.scheduler import Scheduler, SchedulerOutput, SeqUpdate
from asyncpaged.errors import RequestFailedError
from asyncpaged.model.prompt_logprobs import PromptLogprobRows
from asyncpaged.model.runner import SampledToken
from asyncpaged.outputs import Logprob
from asyncpaged.streams import RequestState
from asyncpaged.structured_outputs import GrammarBackend

Rows = dict[tuple[int, int], SampledToken]  # (seq id, sample index) -> its sampled token


def tokens_by_seq(
    sampled: Iterable[SampledToken],
) -> tuple[Rows, dict[int, list[int]], dict[int, tuple[tuple[int, float], ...]]]:
    """The step's rows by (seq id, sample index); each sequence's new tokens, in row order
    (speculative: the kept proposals, then the target's token); each sequence's first row's
    top logprobs."""
    by_row = {(t.seq_id, t.sample_index): t for t in sampled}
    tokens: dict[int, list[int]] = {}
    for (seq_id, _), t in sorted(by_row.items()):
        if t.accepted:  # speculative: the kept proposals, then the target's token
            tokens[seq_id] = [*t.accepted, t.token_id]
        else:
            tokens.setdefault(seq_id, []).append(t.token_id)
    top = {t.seq_id: t.top_logprobs for t in by_row.values() if t.sample_index == 0}
    return by_row, tokens, top


def fail_requests_of(
    out: SchedulerOutput,
    failed: list[SampledToken],
    scheduler: Scheduler,
    states: dict[str, RequestState],
    log: LibraryLogger,
) -> None:
    """Rows whose logits processor raised: each such request fails alone (its waiter gets
    RequestFailedError, its blocks are freed by the next transaction)."""
    if not failed:
        return
    owner = {s.seq_id: s.request_id for s in out.seqs}
    for token in failed:
        rid = owner[token.seq_id]
        if scheduler.abort(rid) is None:
            continue  # another row of it failed first
        state = states.pop(rid)
        error = RequestFailedError(f"request {rid!r}: its logits processor raised")
        error.__cause__ = token.error
        state.fail_alone(error)
        log.info("request_failed", request_id=rid, error=repr(token.error))


def record_prompt_logprobs(
    out: SchedulerOutput,
    rows: tuple[PromptLogprobRows, ...],
    scheduler: Scheduler,
    states: dict[str, RequestState],
    tokenizer: Any,
) -> None:
    """The step's prompt logprobs, recorded before its tokens (the first output has them
    all); a request whose prompt logprobs are complete reads the prefix cache again."""
    if not rows:
        return
    owner = {s.seq_id: s.request_id for s in out.seqs}
    for chunk in rows:
        rid = owner[chunk.seq_id]
        state = states.get(rid)
        if state is None:
            continue  # aborted or failed meanwhile
        detokenizer = tokenizer if state.params.detokenize else None
        request = scheduler.requests.get(rid)
        if state.add_prompt_logprobs(chunk, detokenizer) and request is not None:
            request.read_prefix_cache = True


def accept_grammar_tokens(state: RequestState, index: int, tokens: Sequence[int]) -> bool:
    """Feed a completion's new tokens to its matcher; False if the grammar refused one
    (the bitmask allowed it, so only a stop token past the end can)."""
    matcher = state.matchers.get(index)
    if matcher is None:
        return True
    return all(matcher.accept_token(t) or matcher.is_terminated() for t in tokens)


def jump_forward(
    state: RequestState, upd: SeqUpdate, scheduler: Scheduler, grammars: GrammarBackend | None
) -> tuple[SeqUpdate, int]:
    """Structured outputs' jump-forward: after a sampled token, append the tokens the
    grammar forces next (``EngineConfig.structured_outputs_jump_forward``); the next step
    computes them as a chunk. Not for requests that report logprobs (a forced token's
    logprob is never computed) or rank by them (best_of). Returns the update with them and
    their number."""
    matcher = state.matchers.get(upd.completion)
    if (
        matcher is None or grammars is None or not grammars.jump_forward
        or upd.finish_reason is not None or state.params.logprobs is not None
        or state.ranks_by_logprob
    ):  # fmt: skip
        return upd, 0
    forced = grammars.jump_forward_tokens(matcher)
    if not forced:
        return upd, 0
    appended, reason, stop = scheduler.append_forced(upd.request_id, upd.seq_id, forced)
    return upd._replace(new_token_ids=upd.new_token_ids + appended,
                        finish_reason=reason, stop_reason=stop), len(appended)  # fmt: skip


def record_tokens(
    state: RequestState, upd: SeqUpdate, token: SampledToken, scheduler: Scheduler, tokenizer: Any
) -> bool:
    """One completion's new tokens into its state; a stop string found in their text ends
    the sequence in the scheduler. True if the completion finished (then its request may
    have)."""
    if state.completions[upd.completion].finish_reason is not None:
        return False  # aborted since its tokens were sampled
    params = state.params
    logprobs = None
    if token.logprob is not None:
        logprobs = _logprobs(token, params.logprobs, tokenizer if params.detokenize else None)
    matched = state.add_tokens(
        upd.completion, upd.new_token_ids, upd.finish_reason, upd.stop_reason, logprobs
    )
    if matched is not None:
        scheduler.finish_seq(upd.request_id, upd.seq_id, "stop", matched)
    return upd.finish_reason is not None or matched is not None


def _logprobs(token: SampledToken, num_top: int | None, tokenizer: Any) -> dict[int, Logprob]:
    """The sampled token's logprob and the top ``num_top`` (vLLM's per-position dict), each
    with its text (``tokenizer.decode([id])``, as vLLM fills ``decoded_token``) when a
    tokenizer is given."""

    def text(token_id: int) -> str | None:
        return None if tokenizer is None else str(tokenizer.decode([token_id]))

    top = enumerate(token.top_logprobs[: num_top or 0], 1)
    out = {tid: Logprob(logprob=lp, rank=rank, decoded_token=text(tid)) for rank, (tid, lp) in top}
    assert token.logprob is not None
    out[token.token_id] = Logprob(
        logprob=token.logprob, rank=token.rank, decoded_token=text(token.token_id)
    )
    return out
