"""Sampling options kept in the runner (``worker/kept_options.py``): over random plans (each
sequence present or not, its options the same object as before, a new one, or none), the
rows the runner resolves carry exactly the options the sender meant, and a row that keeps
options its sequence did not have in the last plan is refused."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import event, given

from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.worker.kept_options import KeptOptions, OptionDeltas
from asyncpaged.worker.protocol import SequenceStep


def row(seq_id: int, sampling: SamplingOptions | None, keep: bool = False) -> SequenceStep:
    return SequenceStep(seq_id, (1,), 0, (0,), (0,), sampling is not None or keep,
                        sampling=sampling, keep_sampling=keep)  # fmt: skip


@given(data=st.data())
def test_the_runner_resolves_what_the_sender_meant(data: st.DataObject) -> None:
    sender, runner = OptionDeltas(), KeptOptions()
    current: dict[int, SamplingOptions | None] = {}  # each sequence's options object now
    num_kept = 0
    for _ in range(data.draw(st.integers(1, 12), label="plans")):
        seq_ids = data.draw(st.lists(st.integers(0, 5), unique=True), label="sequences")
        sender.start_plan()
        sent, meant = [], []
        for seq_id in seq_ids:
            change = data.draw(st.sampled_from(["same", "new", "none"]), label="options")
            if change == "new" or seq_id not in current:
                current[seq_id] = SamplingOptions(temperature=0.5, seed=seq_id)
            elif change == "none":
                current[seq_id] = None
            options = current[seq_id]
            sampling, keep = sender.delta(seq_id, options)
            num_kept += keep
            sent.append(row(seq_id, sampling, keep))
            meant.append(options)
        if data.draw(st.booleans(), label="sent"):
            sender.sent()
            resolved = runner.update(tuple(sent))
            assert [s.sampling for s in resolved] == meant
            assert all(a is b for a, b in zip((s.sampling for s in resolved), meant, strict=True))
            assert not any(s.keep_sampling for s in resolved)
        # (a plan built and not sent changes nothing on either side)
    event("kept options" if num_kept else "none kept")


def test_a_row_keeping_options_its_sequence_did_not_have_is_refused() -> None:
    runner = KeptOptions()
    options = SamplingOptions(temperature=0.5)
    runner.update((row(1, options), row(2, None)))
    assert runner.update((row(1, None, keep=True),))[0].sampling is options
    with pytest.raises(AssertionError, match="never sent"):
        runner.update((row(2, None, keep=True),))  # it had no options
    runner.update((row(3, options),))
    with pytest.raises(AssertionError, match="never sent"):
        runner.update((row(1, None, keep=True),))  # absent from the last plan: forgotten
