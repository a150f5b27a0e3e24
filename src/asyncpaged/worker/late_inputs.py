"""Sampling inputs that reach the runner after their step started (async scheduling).

A step planned ahead of the one in flight may sample a row whose sampling depends on the token
the step in flight samples: a grammar's bitmask (the matcher must accept that token first,
jump-forward included), or options that read the output (bad words' banned next tokens, the
output that logits processors see, a min_tokens mask near its end). Those exist only once the
step in flight is back. So the step starts without them (``StepPlan.late_rows`` names those
rows), and the runner takes them after the forward, just before sampling: the loop makes them
while the forward runs (vLLM v1 likewise fills its bitmask while the forward runs). A row with
neither options nor a bitmask in the delivery samples as planned: its sample is discarded (a
grammar forced the tokens that follow, see ``Scheduler.append_forced``) or its request has
ended.

Every step with late rows gets exactly one delivery, sent after the step before it is back and
before the next step, so deliveries are taken in step order. On the runner's thread they pass
through a :class:`LateInputs`; to a runner in its own process they go down its pipe
(``runner_process``).
"""

from __future__ import annotations

import dataclasses
import queue
from typing import TYPE_CHECKING, Protocol

from asyncpaged.sampling.options import SamplingOptions

if TYPE_CHECKING:
    from asyncpaged.worker.protocol import LateDelivery, SequenceStep


class LateSource(Protocol):
    def take(self, rows: tuple[int, ...]) -> LateDelivery:
        """The delivery for the step whose late rows are ``rows`` (waiting for it)."""
        ...


class LateInputs:
    """Hands deliveries from the event loop to the runner's thread, in order. A step whose
    inputs will never come (the engine stops first) is given an empty delivery by the
    executor, so a take never waits forever."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[LateDelivery] = queue.SimpleQueue()

    def put(self, delivery: LateDelivery) -> None:
        self._queue.put(delivery)

    def take(self, rows: tuple[int, ...]) -> LateDelivery:
        """The next delivery (blocking until it comes), which must be for ``rows``."""
        return checked(self._queue.get(), rows)


def checked(delivery: LateDelivery, rows: tuple[int, ...]) -> LateDelivery:
    """``delivery``, after checking that it is for ``rows``."""
    assert delivery.rows == rows, f"late inputs for rows {delivery.rows}, expected {rows}"
    return delivery


def with_late_inputs(
    seqs: tuple[SequenceStep, ...], delivery: LateDelivery
) -> tuple[SequenceStep, ...]:
    """A step's rows with its late rows' inputs put in: options that read the output replace
    the planned ones (None: plain greedy), and grammar bitmasks go into the options. The
    same rows when the delivery holds neither."""
    if not delivery.options and not delivery.masked:
        return seqs
    options = dict(delivery.options)
    masks = delivery.masks_by_seq()
    out = list(seqs)
    for i, s in enumerate(seqs):
        if s.seq_id not in options and s.seq_id not in masks:
            continue
        opt = options.get(s.seq_id, s.sampling)
        mask = masks.get(s.seq_id)
        if mask is not None:
            opt = (
                SamplingOptions(temperature=0.0, token_bitmask=mask)
                if opt is None
                else dataclasses.replace(opt, token_bitmask=mask)
            )
        if opt is not s.sampling:
            out[i] = s._replace(sampling=opt)
    return tuple(out)
