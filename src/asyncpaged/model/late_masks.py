"""Grammar bitmasks that reach the runner after their step started (async scheduling with
structured outputs).

A step planned ahead of the one in flight may sample a constrained row whose grammar has not
seen the token the step in flight samples: that row's bitmask exists only once the step in
flight is back and the scheduler actor's matcher has accepted its token (jump-forward
included). So the step starts without it (``StepPlan.late_masks`` names those rows), and the
runner takes the bitmasks after the forward, just before sampling: the loop computes them
while the forward runs (vLLM v1 likewise fills the bitmask while its forward runs). A row
without a bitmask in the delivery samples unconstrained: its sample is void (a grammar forced
the tokens that follow, see ``Scheduler.append_forced``) or its request has ended.

Every step with late-mask rows gets exactly one delivery, sent after that step and before the
next one, so deliveries are taken in step order. On the runner's thread they pass through a
:class:`LateMasks`; to a runner in its own process they go down its pipe
(``runner_process``).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class MaskDelivery:
    """The bitmasks of one step's late-mask rows: ``rows`` is that step's
    ``StepPlan.late_masks``; ``masks[i]`` ([ceil(V / 32)] int32) belongs to ``masked[i]``, a
    subset of ``rows`` (the others sample unconstrained)."""

    rows: tuple[int, ...]
    masked: tuple[int, ...]
    masks: np.ndarray  # [len(masked), ceil(V / 32)] int32

    def by_seq(self) -> dict[int, torch.Tensor]:
        """Each masked row's bitmask, by sequence id."""
        tensor = torch.from_numpy(self.masks)
        return dict(zip(self.masked, tensor.unbind(0), strict=True))


class MaskSource(Protocol):
    def take(self, rows: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """The bitmasks of the step whose late-mask rows are ``rows`` (waiting for them)."""
        ...


class LateMasks:
    """Hands deliveries from the event loop to the runner's thread, in order.

    Invariant: after :meth:`close` every :meth:`take`, waiting or to come, raises (a runner
    waiting for a delivery that will never come must not hold the engine's shutdown).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[MaskDelivery | None] = queue.SimpleQueue()

    def put(self, delivery: MaskDelivery) -> None:
        self._queue.put(delivery)

    def close(self) -> None:
        self._queue.put(None)

    def take(self, rows: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """The next delivery (blocking until it comes), which must be for ``rows``."""
        delivery = self._queue.get()
        if delivery is None:
            self._queue.put(None)  # for any later take
            raise RuntimeError("the engine stopped before a step's grammar bitmasks came")
        return checked(delivery, rows)


def checked(delivery: MaskDelivery, rows: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """``delivery``'s bitmasks by sequence id, after checking that it is for ``rows``."""
    assert delivery.rows == rows, f"bitmasks for rows {delivery.rows}, expected {rows}"
    return delivery.by_seq()
