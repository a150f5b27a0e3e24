"""The penalty histories of the persistent input batch (``worker/input_batch.py``): the
scheduler's tails (``SentBatch.history_start``), applied by the runner's ``InputBatch``, give
every penalized row exactly the seen tokens and counts of its whole history, in every step,
whatever the sequences do between steps; and the penalties computed from them are
bit-identical to the ones computed from the whole token lists."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.sampling.logits import penalize_rows_
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.worker.input_batch import InputBatch, SentBatch
from asyncpaged.worker.protocol import SequenceStep
from tests.model.test_sampler import _dense_penalties

VOCAB = 50
# What a sequence can do between two steps (its output only grows while it lives: recompute
# keeps it, and the rows that may hold unverified tokens send their history whole), or "ahead":
# its row is planned while the step sampling its next token is in flight (async scheduling).
EDITS = ("grow", "grow_many", "absent", "whole", "ahead")


def _row(
    sender: SentBatch,
    seq_id: int,
    prompt: tuple[int, ...],
    output: list[int],
    rep: float,
    late: bool = False,
) -> SequenceStep:
    """The row the scheduler side builds (as ``StepBuilder`` does, ``actors.step_builder``): the
    request's options, the same every step, and the history's delta."""
    token_ids = [*prompt, *output]
    start = sender.history_start(seq_id, token_ids, len(prompt), late=late)
    options = SamplingOptions(
        temperature=0.0, repetition_penalty=rep, frequency_penalty=0.5, presence_penalty=0.25,
        prompt_token_ids=prompt, history_seq=seq_id,
    )  # fmt: skip
    return SequenceStep(seq_id, (output[-1] if output else 1,), len(token_ids) - 1, (0,), (),
                        True, sampling=options,
                        history=(start, tuple(output[start:]), late))  # fmt: skip


def _whole(seq_id: int, prompt: tuple[int, ...], output: list[int], rep: float) -> SequenceStep:
    """A row that sends its whole history (a verification or fork row)."""
    options = SamplingOptions(temperature=0.0, repetition_penalty=rep,
                              prompt_token_ids=prompt, output_token_ids=tuple(output))  # fmt: skip
    return SequenceStep(seq_id, (1,), len(prompt) + len(output) - 1, (0,), (), True,
                        sampling=options)  # fmt: skip


def _expected(prompt: tuple[int, ...], output: list[int], rep: float) -> dict[int, float]:
    """The brute-force history: every distinct seen token -> its output count."""
    seen = dict.fromkeys(prompt, 0.0) if rep != 1.0 else {}
    for t, n in Counter(output).items():
        seen[t] = float(n)
    return seen


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_tails_rebuild_every_history(data: st.DataObject) -> None:
    sender, runner = SentBatch(), InputBatch()
    num_seqs = data.draw(st.integers(1, 6))
    tokens = st.integers(0, VOCAB - 1)
    prompts = {s: tuple(data.draw(st.lists(tokens, min_size=1, max_size=8))) for s in
               range(num_seqs)}  # fmt: skip
    reps = {s: data.draw(st.sampled_from([1.0, 1.3])) for s in range(num_seqs)}
    outputs: dict[int, list[int]] = {s: [] for s in range(num_seqs)}
    held: dict[int, int] = {}  # output tokens the runner holds per sequence
    for _ in range(data.draw(st.integers(1, 20))):
        sender.start_plan()
        rows, whole = [], set()
        in_flight: dict[int, int] = {}  # the last step's token of each row planned ahead
        for s in data.draw(st.permutations(range(num_seqs))):
            edit = data.draw(st.sampled_from(EDITS))
            if edit == "absent":
                continue
            if edit == "ahead" and s in held:  # only after a persistent row in the last plan
                row = _row(sender, s, prompts[s], outputs[s], reps[s], late=True)
                assert row.history == (held[s], (), True)
                in_flight[s] = data.draw(tokens)  # known to the runner only
                outputs[s].append(in_flight[s])  # the scheduler learns it after this plan
                rows.append(row)
                continue
            if edit == "ahead":
                edit = "grow"
            n = data.draw(st.integers(2, 40)) if edit == "grow_many" else 1
            outputs[s] += data.draw(st.lists(tokens, min_size=n, max_size=n))
            if edit == "whole":
                rows.append(_whole(s, prompts[s], outputs[s], reps[s]))
                whole.add(s)
                continue
            row = _row(sender, s, prompts[s], outputs[s], reps[s])
            assert row.history is not None
            # Only what is new travels: the runner holds the output of the last plan.
            assert row.history[0] == held.get(s, 0)
            rows.append(row)
        if not rows:
            continue  # the scheduler actor sends no plan without sequences
        sender.sent()
        seen = runner.update(rows, in_flight.copy).seen
        assert sorted(seen) == sorted(r.seq_id for r in rows if r.seq_id not in whole)
        for s, (ids, counts) in seen.items():
            got = dict(zip(ids.tolist(), counts.tolist(), strict=True))
            assert len(got) == len(ids), "a token twice in one history"
            assert got == _expected(prompts[s], outputs[s], reps[s])
            assert ids.dtype == np.int64
            assert counts.dtype == np.float32
        held = {s: len(outputs[s]) for s in seen}
        assert sorted(runner.history_ids()) == sorted(seen)


def test_a_sequence_that_missed_a_step_sends_its_whole_output() -> None:
    sender, runner = SentBatch(), InputBatch()
    prompt = (7, 8)
    for plan in ({1: [3], 2: [4]}, {2: [4, 4]}, {1: [3, 5, 5], 2: [4, 4, 6]}):
        sender.start_plan()
        rows = [_row(sender, s, prompt, out, 1.2) for s, out in plan.items()]
        sender.sent()
        seen = runner.update(rows, dict).seen
    tails = {r.seq_id: r.history for r in rows}
    assert tails == {1: (0, (3, 5, 5), False), 2: (2, (6,), False)}
    ids, counts = seen[1]
    assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == {7: 0, 8: 0, 3: 1, 5: 2}


def test_a_changed_output_is_sent_whole() -> None:
    sender = SentBatch()
    sender.start_plan()
    assert sender.history_start(1, [9, 3, 4], 1) == 0
    sender.sent()
    sender.start_plan()
    assert sender.history_start(1, [9, 3, 4, 5], 1) == 2  # an extension: the runner holds 2
    sender.start_plan()  # that plan was never sent
    assert sender.history_start(1, [9, 3, 6, 5], 1) == 0  # the token at the held end changed
    assert sender.history_start(1, [9, 3], 1) == 0  # shorter than what the runner holds


def test_the_runner_refuses_a_tail_it_cannot_apply() -> None:
    runner = InputBatch()
    options = SamplingOptions(repetition_penalty=1.2, history_seq=1)
    row = SequenceStep(1, (4,), 5, (0,), (), True, sampling=options, history=(3, (4,), False))
    with pytest.raises(AssertionError, match="holds None output tokens"):
        runner.update([row], dict)
    wrong = SequenceStep(2, (4,), 5, (0,), (), True, sampling=options, history=(0, (), False))
    with pytest.raises(AssertionError, match="carries the penalty history of 1"):
        runner.update([wrong], dict)
    with pytest.raises(AssertionError, match="a kept history, no delta"):
        runner.update([row._replace(history=None)], dict)


@pytest.mark.parametrize("seed", range(4))
def test_kept_histories_penalize_bit_identically(seed: int) -> None:
    """``penalize_rows_`` with the runner's kept histories, kept and listed rows mixed in one
    call, equals the dense form over ``[R, V]`` (the test_sampler reference) bit for bit on the
    rows named, and leaves the others alone."""
    rng = np.random.default_rng(seed)
    vocab, num_rows = 300, 12
    logits = torch.from_numpy(rng.standard_normal((num_rows + 3, vocab)).astype(np.float32))
    logits[0, :5] = 0.0  # signed zeros and ties too
    logits[1, :5] = -0.0
    rows = sorted(rng.choice(num_rows + 3, size=num_rows, replace=False).tolist())
    prompts = [tuple(rng.integers(0, vocab, rng.integers(0, 30)).tolist()) for _ in rows]
    outputs = [tuple(rng.integers(0, vocab, rng.integers(0, 200)).tolist()) for _ in rows]
    reps = torch.tensor(rng.choice([1.0, 0.7, 1.4], num_rows), dtype=torch.float32)
    freqs = torch.tensor(rng.choice([0.0, 0.3, -0.2], num_rows), dtype=torch.float32)
    pres = torch.tensor(rng.choice([0.0, 0.5], num_rows), dtype=torch.float32)
    params = list(zip(reps.tolist(), freqs.tolist(), pres.tolist(), strict=True))
    want = logits.clone()
    want[rows] = _dense_penalties(logits[rows], prompts, outputs, params)
    runner, sender = InputBatch(), SentBatch()
    kept_rows = [i for i in range(num_rows) if i % 3]  # the others stay token lists
    # Two plans: each kept history arrives in two tails, as over two steps.
    for cut in (lambda out: out[: len(out) // 2], lambda out: out):
        sender.start_plan()
        plan = [_row(sender, i, prompts[i], list(cut(outputs[i])), float(reps[i]))
                for i in kept_rows]  # fmt: skip
        sender.sent()
        kept = runner.update(plan, dict).seen
    assert any(r.history is not None and r.history[0] for r in plan)
    seen = [kept.get(i) for i in range(num_rows)]
    got = logits.clone()
    penalize_rows_(got, rows, prompt_token_ids=prompts, output_token_ids=outputs,
                   repetition_penalties=reps, frequency_penalties=freqs,
                   presence_penalties=pres, seen=seen)  # fmt: skip
    assert torch.equal(got, want)
    assert any(x is not None for x in seen)
    assert any(x is None for x in seen)
