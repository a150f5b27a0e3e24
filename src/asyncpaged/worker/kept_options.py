"""Sampling options that persist in the runner between steps: a sequence whose options did not
change since the last step sends none (``SequenceStep.keep_sampling``).

A completion's options are often one object for its whole life (``actors.step_builder``: fixed
options, a seeded row's too since the runner derives its generator keys); pickling that
object for the runner's process at every step, and unpickling it there, was a sixth of the
loop's time on a sampled workload. Both halves of the protocol live here, under the rule of
``block_tables``: **options persist from one plan to the next only for sequences in both**,
with options (not None) in the first. A sequence absent from a plan, or sent without
options, is forgotten; its next options are sent whole. That holds as long as every plan
the sender marks sent is executed, in order, by the runner, and a row with
``keep_sampling`` False works on any runner (plans built by hand send their options).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncpaged.sampling.options import SamplingOptions
    from asyncpaged.worker.protocol import SequenceStep


class OptionDeltas:
    """The sender's side: the options object of each sequence in the last plan sent.

    Invariant: ``_last`` holds the options (not None) of every sequence of the last plan
    :meth:`sent`, which the runner holds once it has executed that plan; ``_next`` those of
    the plan being built.
    """

    def __init__(self) -> None:
        self._last: dict[int, SamplingOptions] = {}
        self._next: dict[int, SamplingOptions] = {}

    def start_plan(self) -> None:
        """Begin building a plan (dropping one built but not sent)."""
        self._next = {}

    def sent(self) -> None:
        """The plan built since :meth:`start_plan` went to the runner."""
        self._last, self._next = self._next, {}

    def delta(
        self, seq_id: int, options: SamplingOptions | None
    ) -> tuple[SamplingOptions | None, bool]:
        """``(sampling, keep_sampling)`` for the row of ``seq_id`` whose options are
        ``options``: ``(None, True)`` where the runner holds this very object already."""
        if options is None:
            return None, False
        self._next[seq_id] = options
        if self._last.get(seq_id) is options:
            return None, True
        return options, False


class KeptOptions:
    """The runner's side: the options of each sequence of the last step that had some."""

    def __init__(self) -> None:
        self._options: dict[int, SamplingOptions] = {}

    def update(self, seqs: Sequence[SequenceStep]) -> tuple[SequenceStep, ...]:
        """The step's rows with every kept row's options put back; remembers the step's."""
        last, kept = self._options, {}
        out: list[SequenceStep] | None = None  # a copy of seqs once a row changes
        for i, s in enumerate(seqs):
            if s.keep_sampling:
                assert s.seq_id in last, f"sequence {s.seq_id} keeps options it never sent"
                if out is None:
                    out = list(seqs)
                out[i] = s._replace(sampling=last[s.seq_id], keep_sampling=False)
                kept[s.seq_id] = last[s.seq_id]
            elif s.sampling is not None:
                kept[s.seq_id] = s.sampling
        self._options = kept
        return tuple(seqs) if out is None else tuple(out)

    def options_of(self, seq_id: int) -> SamplingOptions | None:
        """The options held for ``seq_id`` (the last step's, if it had some)."""
        return self._options.get(seq_id)
