"""After a step: the sampled tokens appended to their sequences under the stop rules, and what
follows from them: speculative proposals verified (the rejected slots roll back next
transaction), parallel-sampling requests fanned out at the prompt's end, beam-search requests
advanced once every beam reported, tokens a grammar forces appended (jump-forward).
Finished sequences' frees are queued on the scheduler.

These are the :class:`~asyncpaged.core.scheduler.Scheduler`'s update steps; each takes the
scheduler whose requests it changes."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SeqOf
from typing import TYPE_CHECKING

from asyncpaged.core.block_table import LATE_TOKEN
from asyncpaged.core.request import Request, Sequence
from asyncpaged.core.scheduler_plan import back_off
from asyncpaged.core.scheduler_types import SchedulerOutput, SeqUpdate, new_tuple

if TYPE_CHECKING:
    from asyncpaged.core.scheduler import Scheduler


def update_step(
    sched: Scheduler,
    output: SchedulerOutput,
    sampled: Mapping[int, SeqOf[int]],
    top: Mapping[int, tuple[tuple[int, float], ...]] | None,
) -> list[SeqUpdate]:
    """:meth:`Scheduler.update`: see there."""
    updates: list[SeqUpdate] = []
    beams: list[Request] = []
    void = sched._void
    for scheduled in output.seqs:
        request = sched.requests.get(scheduled.request_id)
        if request is None or not scheduled.samples:
            # aborted meanwhile, or a prefill chunk short of the prompt's end; a late token's
            # row whose request the step before ended (or an abort) was computed in vain
            if request is None and scheduled.token_ids[0] == LATE_TOKEN:
                sched.num_rows_in_vain += 1
            continue
        seq = request.seqs[0]
        if seq.seq_id != scheduled.seq_id:
            seq = next(s for s in request.seqs if s.seq_id == scheduled.seq_id)
        if seq.is_finished:
            continue
        if void and seq.seq_id in void:  # forced tokens replaced this sample
            void.remove(seq.seq_id)
            sched.num_rows_in_vain += 1
            continue
        if request.beam is not None:
            assert top is not None, "beam search needs the top logprobs"
            request.beam_top[seq.seq_id] = top[seq.seq_id]
            if len(request.beam_top) == len(request.live_seqs):
                beams.append(request)
            continue
        tokens = sampled[seq.seq_id]
        if scheduled.num_draft:
            updates.append(verified(sched, request, seq, scheduled.num_draft, tokens))
            if seq.finish_reason is not None and request.is_finished:
                sched._finish(request)
                sched.num_finished += 1
            continue
        if scheduled.num_samples == 1 and len(request.seqs) == 1:  # the common case
            updates.append(_append_one(sched, request, seq, tokens[0]))
            continue
        updates.extend(_append_family(sched, request, seq, scheduled.num_samples, tokens))
    for request in beams:
        beam_step(sched, request)
    return updates


def _append_one(sched: Scheduler, request: Request, seq: Sequence, token: int) -> SeqUpdate:
    """A single-sequence request's sampled token (the value of its late token, if the step
    after was planned before it came back)."""
    seq.token_ids.append(token)
    if sched._late and seq.seq_id in sched._late:
        sched._late.remove(seq.seq_id)
        sched._pending_late.append((seq.seq_id, token))
    finished = check_stop(request, seq, token)
    update = new_tuple(SeqUpdate, (  # the common case's one allocation per step per row
        request.request_id, seq.seq_id, seq.index, (seq.seq_id, 0), (token,),
        seq.finish_reason, seq.stop_reason,
    ))  # fmt: skip
    if finished:
        sched._release(seq)
        sched._finish(request)
        sched.num_finished += 1
    return update


def _append_family(
    sched: Scheduler, request: Request, seq: Sequence, num_samples: int, tokens: SeqOf[int]
) -> list[SeqUpdate]:
    """A sampled token for ``seq`` of a multi-sequence request; at a fan-out
    (``num_samples > 1``) the other draws start sequences 1.."""
    updates: list[SeqUpdate] = []
    family = [seq]
    if num_samples > 1:
        family.extend(fan_out(sched, request, seq, tokens[1:]))
    for i, (s, token) in enumerate(zip(family, tokens, strict=False)):
        if s is seq:
            s.token_ids.append(token)
            if sched._late and s.seq_id in sched._late:  # (see _append_one)
                sched._late.remove(s.seq_id)
                sched._pending_late.append((s.seq_id, token))
        finished = check_stop(request, s, token)
        updates.append(
            SeqUpdate(
                request_id=request.request_id,
                seq_id=s.seq_id,
                completion=s.index,
                row=(seq.seq_id, i),
                new_token_ids=(token,),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
        )
        if finished:
            sched._release(s)
    if seq.finish_reason is not None if len(request.seqs) == 1 else request.is_finished:
        sched._finish(request)
        sched.num_finished += 1
    return updates


def verified(
    sched: Scheduler, request: Request, seq: Sequence, num_draft: int, tokens: SeqOf[int]
) -> SeqUpdate:
    """A speculative step's result: the accepted proposals then the target's token
    (``tokens``, 1 to ``num_draft + 1`` of them), appended one by one under the stop
    rules. The kept proposals' K/V stay (they become computed tokens); the rejected slots
    roll back in the next transaction, and a sequence that finished is freed instead."""
    accepted = len(tokens) - 1
    assert 0 <= accepted <= num_draft, f"{len(tokens)} tokens for {num_draft} proposals"
    sched.spec_stats.observe((num_draft,), (accepted,))
    if accepted:
        seq.spec_backoff = 0
    else:  # each wasted round doubles the pause before the next proposal (at most 16)
        back_off(sched, seq, sched.num_plans)
    appended = _append_until_stop(sched, request, seq, tokens)
    if not seq.is_finished:
        seq.num_computed_tokens += accepted
        sched._pending_truncates.append((seq.seq_id, seq.num_computed_tokens))
    return SeqUpdate(
        request_id=request.request_id,
        seq_id=seq.seq_id,
        completion=seq.index,
        row=(seq.seq_id, 0),
        new_token_ids=appended,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def beam_step(sched: Scheduler, request: Request) -> None:
    """All beams reported: advance the search, fork, drop, or finish the request."""
    assert request.beam is not None
    choices = request.beam.step(request.beam_top)
    request.beam_top.clear()
    live = {s.seq_id: s for s in request.live_seqs}
    bases = {sid: list(s.token_ids) for sid, s in live.items()}
    kept: list[Sequence] = []
    for index, choice in enumerate(choices):
        parent = live[choice.parent]
        if all(s is not parent for s in kept):
            parent.token_ids.append(choice.token)
            parent.index = index
            kept.append(parent)
            continue
        child = Sequence(
            seq_id=sched._new_seq_id(),
            index=index,
            token_ids=[*bases[parent.seq_id], choice.token],
            num_prompt_tokens=parent.num_prompt_tokens,
            num_computed_tokens=parent.num_computed_tokens,
            has_blocks=True,
        )
        sched._pending_forks.append((parent.seq_id, child.seq_id))
        kept.append(child)
    for seq in live.values():
        if all(s is not seq for s in kept):
            seq.finish_reason = "stop"  # pruned beam
            sched._release(seq)
    request.seqs = kept or list(live.values())
    if not request.beam.done:
        request.beam.assign([s.seq_id for s in kept])
    else:
        for seq in request.live_seqs:
            seq.finish_reason = "stop"
            sched._release(seq)
        sched.finished_beams.append((request.request_id, list(request.beam.finished)))
        sched._finish(request)
        sched.num_finished += 1


def fan_out(
    sched: Scheduler, request: Request, seq: Sequence, tokens: SeqOf[int]
) -> list[Sequence]:
    """Create sequences 1.. of a parallel-sampling request from its first sequence."""
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    children = []
    for index, (child_id, token) in enumerate(zip(request.fork_ids, tokens, strict=True), 1):
        child = Sequence(
            seq_id=child_id,
            index=index,
            token_ids=[*prompt, token],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_computed_tokens=seq.num_computed_tokens,
            has_blocks=True,
        )
        request.seqs.append(child)
        sched._pending_forks.append((seq.seq_id, child_id))
        children.append(child)
    return children


def check_stop(request: Request, seq: Sequence, token: int) -> bool:
    """Set the sequence's finish reason if ``token`` ends it; True if it did."""
    stop = request.stop
    num_tokens = len(seq.token_ids)
    num_generated = num_tokens - seq.num_prompt_tokens
    if num_generated >= stop.min_tokens:
        if token in stop.eos_token_ids and not stop.ignore_eos:
            seq.finish_reason = "stop"
        elif token in stop.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
    if seq.finish_reason is None and (
        num_generated >= stop.max_tokens
        or (stop.max_model_len is not None and num_tokens >= stop.max_model_len)
    ):
        seq.finish_reason = "length"
    return seq.finish_reason is not None


def append_forced(
    sched: Scheduler, request_id: str, seq_id: int, tokens: SeqOf[int]
) -> tuple[tuple[int, ...], str | None, int | str | None]:
    """:meth:`Scheduler.append_forced`: see there."""
    request = sched.requests.get(request_id)
    seq = None if request is None else next(s for s in request.seqs if s.seq_id == seq_id)
    if request is None or seq is None or seq.is_finished:
        return (), None, None
    if tokens and seq.num_computed_tokens == len(seq.token_ids):  # a step planned ahead
        sched._void.add(seq.seq_id)  # samples next: that sample is void
    appended = _append_until_stop(sched, request, seq, tokens)
    if request.is_finished:  # this sequence stopped, and it was the request's last
        sched._finish(request)
        sched.num_finished += 1
    return appended, seq.finish_reason, seq.stop_reason


def _append_until_stop(
    sched: Scheduler, request: Request, seq: Sequence, tokens: SeqOf[int]
) -> tuple[int, ...]:
    """Append ``tokens`` one by one under the stop rules; the first that stops the sequence
    is the last appended, and the sequence is released. Returns what was appended."""
    for i, token in enumerate(tokens):
        seq.token_ids.append(token)
        if check_stop(request, seq, token):
            sched._release(seq)
            return tuple(tokens[: i + 1])
    return tuple(tokens)
