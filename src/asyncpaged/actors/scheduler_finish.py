"""A finished step at the scheduler actor (``actors/scheduler.py``), the part the next plan
depends on: :func:`finish_step` takes its ``StepDone`` (the core's updates, failed rows,
grammars and jump-forward, finished beams) and sorts its tokens into the actor's outputs;
:func:`check_stops` has the output processor check the tokens of requests with stop strings
before the next plan; either then sends the late inputs of the step in flight. Each takes the
actor whose records and pending outputs it changes; the helpers they call are in
:mod:`.scheduler_outputs` and :mod:`.scheduler_late`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from asyncpaged.actors.scheduler_late import late_inputs
from asyncpaged.actors.scheduler_outputs import (
    accept_grammar_tokens,
    failed_requests,
    grammar_stop,
    jump_forward,
    tokens_by_seq,
)
from asyncpaged.core.scheduler import SchedulerOutput
from asyncpaged.core.scheduler_types import new_tuple
from asyncpaged.messages import DeliverLate, RecordOutputs, TokenOutput
from asyncpaged.model.runner import SampledToken

if TYPE_CHECKING:
    from asyncpaged.actors.scheduler import SchedulerActor


def finish_step(
    actor: SchedulerActor, out: SchedulerOutput, sampled: Iterable[SampledToken]
) -> None:
    """A step's results, the part the next plan depends on: the scheduler's appends and
    stop rules, failed rows, grammar matchers and jump-forward; the late inputs of the
    step in flight (then, or after :func:`check_stops`). The tokens of requests with stop
    strings wait for :func:`check_stops` (before the next plan), the others for the actor's
    ``_deliver`` (after the next step is sent, while its forward runs)."""
    sampled = list(sampled)
    failed = [t for t in sampled if t.error is not None]
    for rid, error in failed_requests(out, failed, actor.scheduler, actor._log):
        actor._end(rid, error)
    by_row, tokens, top = tokens_by_seq(sampled)
    updates = actor.scheduler.update(out, tokens, top)
    if actor._draft_proposals is not None:
        actor._draft_proposals.record(out.seqs, sampled)
    ended: list[str] = []
    for update in updates:
        tracked = actor._tracked[update.request_id]
        upd = update
        if tracked.matchers:
            if not accept_grammar_tokens(tracked.matchers, upd.completion, upd.new_token_ids):
                actor._log.warning("grammar_rejected_token", request_id=upd.request_id,
                                   tokens=list(upd.new_token_ids))  # fmt: skip
            stops, reason = grammar_stop(tracked.info, tracked.matchers, upd, actor._eos)
            if stops:
                actor.scheduler.finish_seq(upd.request_id, upd.seq_id, "stop", reason)
                upd = upd._replace(finish_reason="stop", stop_reason=reason)
            # + the tokens the grammar forces
            upd, num_forced = jump_forward(tracked.info, tracked.matchers, upd,
                                           actor.scheduler, actor._grammars)  # fmt: skip
            actor.num_jump_forward_tokens += num_forced
        token = new_tuple(TokenOutput, (upd, by_row[upd.row]))
        if tracked.info.params.stop:
            actor._stop_tokens.append(token)
        else:
            actor._tokens.append(token)
            if upd.finish_reason is not None:
                ended.append(upd.request_id)
    for rid in ended:  # once all its completions' updates are taken
        _forget_if_gone(actor, rid)
    # the step in flight samples rows whose inputs read this step's tokens: they are
    # made now, or once the stop check knows which sequences a stop string ended
    actor._late_back = bool(actor._late_due)
    if not actor._stop_tokens:
        _send_late(actor)
    eos = actor._eos
    for rid, hypotheses in actor.scheduler.finished_beams:
        actor._beams.append((rid, tuple((tuple(h.tokens), h.logprob, h.tokens[-1] in eos)
                                        for h in hypotheses)))  # fmt: skip
        actor._tracked.pop(rid, None)
    actor.scheduler.finished_beams.clear()


async def check_stops(actor: SchedulerActor) -> None:
    """The last step's tokens of requests with stop strings, to the output processor, which
    records them (held from their readers until the next delivery) and answers which
    sequences a stop string ended; those end here, before the next plan. Cancelled midway
    (the actor's task cancelled), nothing is undone: the output processor may hold the
    tokens recorded."""
    tokens, actor._stop_tokens = actor._stop_tokens, []
    prompt_logprobs, actor._prompt_logprobs = actor._prompt_logprobs, []
    actor._outputs.send_nowait(RecordOutputs(tokens=tuple(tokens),
                                             prompt_logprobs=tuple(prompt_logprobs),
                                             check_stops=True))  # fmt: skip
    actor._release_due = True
    verdict = await actor._stop_replies.receive()
    for rid, seq_id, matched in verdict.matches:
        actor.scheduler.finish_seq(rid, seq_id, "stop", matched)
    for token in tokens:
        _forget_if_gone(actor, token.update.request_id)
    _send_late(actor)


def _forget_if_gone(actor: SchedulerActor, request_id: str) -> None:
    if request_id not in actor.scheduler.requests:
        actor._tracked.pop(request_id, None)


def _send_late(actor: SchedulerActor) -> None:
    """The late inputs of the step in flight (``late_inputs``), once the step before it is
    back and its stop strings checked (a sequence one ended samples in vain and plain, so
    no logits processor sees a row the sync engine never computes)."""
    if not actor._late_back:
        return
    due, actor._late_due, actor._late_back = actor._late_due, (), False
    delivery = late_inputs(due, actor.scheduler, actor._tracked, actor._grammars,
                           actor._eos, actor._bad_words,
                           keeps_histories=actor._draft_proposals is None)  # fmt: skip
    actor._executor.send_nowait(DeliverLate(delivery=delivery))
