"""The persistent input batch (``worker/input_batch.py``): the scheduler's :class:`SentBatch`
turns each row into its changes since the last plan sent, the runner's :class:`InputBatch`
applies them, and over random plans (sequences coming and going, tables edited, options kept,
replaced or dropped, penalized outputs growing, rows planned ahead, some plans never sent) the
runner resolves every step exactly as a whole resend of every row would; tables and options in
detail here, penalty histories in ``test_input_batch_histories``."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.worker.input_batch import InputBatch, ResolvedRows, SentBatch
from asyncpaged.worker.protocol import SequenceStep

# What a table can do between two steps where its sequence runs.
EDITS = ("same", "append", "cow_last", "truncate", "replace", "absent")


def table_row(seq_id: int, start: int, blocks: tuple[int, ...]) -> SequenceStep:
    """A row that only moves a table (greedy, no options)."""
    return SequenceStep(seq_id, (1,), 0, (0,), blocks, False, table_start=start)


def edit_table(draw: st.DrawFn, table: tuple[int, ...], edit: str, next_block: int) -> tuple[
    tuple[int, ...], int
]:  # fmt: skip
    """``table`` after ``edit`` (fresh block ids from ``next_block`` on), and the next free id."""
    if edit == "append" or not table:
        grow = draw(st.integers(1, 40))
        return table + tuple(range(next_block, next_block + grow)), next_block + grow
    if edit == "cow_last":
        return (*table[:-1], next_block), next_block + 1
    if edit == "truncate":
        return table[: draw(st.integers(0, len(table) - 1))] or (next_block,), next_block + 1
    if edit == "replace":  # swapped back in, or recomputed: new blocks throughout
        return tuple(range(next_block, next_block + len(table))), next_block + len(table)
    return table, next_block


@st.composite
def table_plans(draw: st.DrawFn) -> list[dict[int, tuple[int, ...]]]:
    """Plans as {seq_id: its true table}, each derived from the last by random edits."""
    num_seqs = draw(st.integers(1, 12))
    tables: dict[int, tuple[int, ...]] = {}
    plans = []
    next_block = 0
    for _ in range(draw(st.integers(1, 25))):
        plan = {}
        for seq_id in range(num_seqs):
            edit = draw(st.sampled_from(EDITS))
            if edit == "absent":
                continue
            table, next_block = edit_table(draw, tables.get(seq_id, ()), edit, next_block)
            tables[seq_id] = plan[seq_id] = table
        order = draw(st.permutations(sorted(plan)))
        plans.append({seq_id: plan[seq_id] for seq_id in order})
    return plans


def padded(tables: list[tuple[int, ...]]) -> np.ndarray:
    width = max(map(len, tables), default=0) or 1
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out


@settings(max_examples=300, deadline=None)
@given(table_plans())
def test_table_deltas_rebuild_every_true_table(plans: list[dict[int, tuple[int, ...]]]) -> None:
    sender, runner = SentBatch(), InputBatch(rows=2, width=2)  # small: both grow
    last: dict[int, tuple[int, ...]] = {}
    seen = {seq_id for p in plans for seq_id in p}
    for plan in plans:
        if not plan:  # the scheduler actor sends no plan without sequences
            continue
        sender.start_plan()
        rows = []
        for seq_id, table in plan.items():
            start, blocks = sender.table(seq_id, table)
            rows.append(table_row(seq_id, start, blocks))
            # Only what changed travels: an unchanged or appended table keeps its old entries.
            before = last.get(seq_id)
            if before is not None and table[: len(before)] == before:
                assert (start, blocks) == (len(before), table[len(before) :])
            elif before is None:
                assert start == 0
        sender.sent()
        resolved = runner.update(rows)
        np.testing.assert_array_equal(resolved.tables, padded(list(plan.values())))
        assert resolved.num_blocks.tolist() == [len(t) for t in plan.values()]
        assert sorted(runner.seq_ids()) == sorted(plan)
        # every sequence's own row holds its table (no two sequences share a row)
        assert all(runner.table(seq_id) == table for seq_id, table in plan.items())
        assert runner.capacity <= max(2, 2 * len(seen))  # rows of dropped sequences reused
        last = dict(plan)


def test_a_sequence_that_missed_a_step_gets_its_whole_table() -> None:
    sender, runner = SentBatch(), InputBatch()
    for plan in ({1: (5, 6), 2: (7,)}, {2: (7,)}, {1: (5, 6, 8), 2: (7,)}):
        sender.start_plan()
        rows = [table_row(s, *sender.table(s, t)) for s, t in plan.items()]
        sender.sent()
        runner.update(rows)
    assert [(r.table_start, r.block_table) for r in rows] == [(0, (5, 6, 8)), (1, ())]
    assert runner.table(1) == (5, 6, 8)
    assert runner.table(2) == (7,)


def test_the_runner_refuses_a_table_delta_it_cannot_apply() -> None:
    runner = InputBatch()
    with pytest.raises(AssertionError, match="was not in the last step"):
        runner.update([table_row(1, 2, (9,))])
    runner = InputBatch()
    runner.update([table_row(1, 0, (4, 5))])
    with pytest.raises(AssertionError, match="past its 2 blocks"):
        runner.update([table_row(1, 3, (9,))])
    runner = InputBatch()
    with pytest.raises(AssertionError, match="appears twice"):
        runner.update([table_row(1, 0, (4,)), table_row(1, 0, (5,))])


def test_a_plan_built_but_not_sent_changes_nothing() -> None:
    sender, runner = SentBatch(), InputBatch()
    options = SamplingOptions(temperature=0.5)
    sender.start_plan()
    start, blocks = sender.table(1, (4, 5))
    sampling, keep = sender.options(1, options)
    runner.update([table_row(1, start, blocks)._replace(sampling=sampling, keep_sampling=keep)])
    sender.sent()
    sender.start_plan()  # a plan that fails to build (or is never sent) ...
    assert sender.table(1, (4, 5, 6, 7)) == (2, (6, 7))
    assert sender.options(1, SamplingOptions(temperature=0.7)) == (
        SamplingOptions(temperature=0.7), False
    )  # fmt: skip
    sender.start_plan()  # ... and the next one is relative to what the runner holds
    start, blocks = sender.table(1, (4, 5, 6))
    assert (start, blocks) == (2, (6,))
    assert sender.options(1, options) == (None, True)
    sender.sent()
    resolved = runner.update([table_row(1, start, blocks)._replace(keep_sampling=True)])
    assert runner.table(1) == (4, 5, 6)
    assert resolved.seqs[0].sampling is options


def options_row(seq_id: int, sampling: SamplingOptions | None, keep: bool = False) -> SequenceStep:
    return SequenceStep(seq_id, (1,), 0, (0,), (0,), sampling is not None or keep,
                        sampling=sampling, keep_sampling=keep)  # fmt: skip


@given(data=st.data())
def test_the_runner_resolves_the_options_the_sender_meant(data: st.DataObject) -> None:
    """Over random plans (each sequence present or not, its options the same object as
    before, a new one, or none; some plans never sent), the rows the runner resolves carry
    exactly the options the sender meant."""
    sender, runner = SentBatch(), InputBatch()
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
            sampling, keep = sender.options(seq_id, options)
            num_kept += keep
            sent.append(options_row(seq_id, sampling, keep))
            meant.append(options)
        if data.draw(st.booleans(), label="sent"):
            sender.sent()
            resolved = runner.update(tuple(sent)).seqs
            assert [s.sampling for s in resolved] == meant
            assert all(a is b for a, b in zip((s.sampling for s in resolved), meant, strict=True))
            assert not any(s.keep_sampling for s in resolved)
            assert all(runner.options_of(s) is o for s, o in zip(seq_ids, meant, strict=True))
        # (a plan built and not sent changes nothing on either side)
    event("kept options" if num_kept else "none kept")


def test_a_row_keeping_options_its_sequence_did_not_have_is_refused() -> None:
    runner = InputBatch()
    options = SamplingOptions(temperature=0.5)
    runner.update((options_row(1, options), options_row(2, None)))
    assert runner.update((options_row(1, None, keep=True),)).seqs[0].sampling is options
    with pytest.raises(AssertionError, match="never sent"):
        runner.update((options_row(2, None, keep=True),))  # it had no options
    runner = InputBatch()
    runner.update((options_row(1, options),))
    runner.update((options_row(3, options),))
    with pytest.raises(AssertionError, match="never sent"):
        runner.update((options_row(1, None, keep=True),))  # absent from the last plan: forgotten


def test_rows_without_kept_options_come_back_as_the_same_tuple() -> None:
    runner = InputBatch()
    rows = (options_row(1, SamplingOptions(temperature=0.5)), options_row(2, None))
    assert runner.update(rows).seqs is rows


# ---- the whole protocol at once -------------------------------------------------------------

OPTION_CHANGES = ("same", "new", "none", "penalized")
VOCAB = 40


def _penalized(seq_id: int, prompt: tuple[int, ...], rep: float) -> SamplingOptions:
    return SamplingOptions(temperature=0.0, repetition_penalty=rep, frequency_penalty=0.5,
                           prompt_token_ids=prompt, history_seq=seq_id)  # fmt: skip


def _expected_seen(prompt: tuple[int, ...], output: list[int], rep: float) -> dict[int, float]:
    seen = dict.fromkeys(prompt, 0.0) if rep != 1.0 else {}
    for t, n in Counter(output).items():
        seen[t] = float(n)
    return seen


def _same_resolution(got: ResolvedRows, want: ResolvedRows) -> None:
    assert [s.sampling for s in got.seqs] == [s.sampling for s in want.seqs]
    assert all(a.sampling is b.sampling for a, b in zip(got.seqs, want.seqs, strict=True))
    assert not any(s.keep_sampling for s in got.seqs)
    np.testing.assert_array_equal(got.num_blocks, want.num_blocks)
    np.testing.assert_array_equal(got.tables, want.tables)
    assert sorted(got.seen) == sorted(want.seen)
    for seq_id, (ids, counts) in got.seen.items():
        w_ids, w_counts = want.seen[seq_id]
        assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == dict(
            zip(w_ids.tolist(), w_counts.tolist(), strict=True)
        )


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_the_runner_always_sees_what_a_whole_resend_gives(data: st.DataObject) -> None:
    """One sender, one runner, random plans: every sent plan resolves to what the same rows
    sent whole (``table_start`` 0, their options, their whole output) resolve to on a fresh
    runner; plans never sent change nothing; rows planned ahead get the runner's placeholder."""
    draw = data.draw
    sender, runner = SentBatch(), InputBatch(rows=2, width=2)
    num_seqs = draw(st.integers(1, 6))
    tokens = st.integers(0, VOCAB - 1)
    prompts = {s: tuple(draw(st.lists(tokens, min_size=1, max_size=6))) for s in range(num_seqs)}
    reps = {s: draw(st.sampled_from([1.0, 1.3])) for s in range(num_seqs)}
    tables: dict[int, tuple[int, ...]] = {}
    options: dict[int, SamplingOptions | None] = {}
    outputs: dict[int, list[int]] = {s: [] for s in range(num_seqs)}
    next_block = 0
    num_unsent = num_placeholders = 0
    for _ in range(draw(st.integers(1, 15))):
        sender.start_plan()
        rows, whole = [], []
        in_flight: dict[int, int] = {}  # the last step's token of each row planned ahead
        for s in draw(st.permutations(range(num_seqs))):
            edit = draw(st.sampled_from(EDITS))
            if edit == "absent":
                continue
            tables[s], next_block = edit_table(draw, tables.get(s, ()), edit, next_block)
            change = draw(st.sampled_from(OPTION_CHANGES))
            if change == "new" or (change == "same" and s not in options):
                options[s] = SamplingOptions(temperature=0.5, seed=s)
            elif change == "none":
                options[s] = None
            elif change == "penalized" and (options.get(s) is None
                                            or options[s].history_seq is None):  # fmt: skip
                options[s] = _penalized(s, prompts[s], reps[s])
            opts = options[s]
            keeps = opts is not None and opts.history_seq is not None
            late = keeps and draw(st.booleans())
            if not late:  # (a row planned ahead knows no token since the last plan)
                outputs[s] += draw(st.lists(tokens, min_size=1, max_size=3))
            start, blocks = sender.table(s, tables[s])
            history = None
            if keeps:
                known = [*prompts[s], *outputs[s]]
                first = sender.history_start(s, known, len(prompts[s]), late=late)
                history = (first, tuple(outputs[s][first:]), late)
            sampling, keep = sender.options(s, opts)
            token = (PLACEHOLDER_TOKEN,) if late else (1,)
            rows.append(SequenceStep(s, token, 0, (0,), blocks, opts is not None,
                                     sampling=sampling, keep_sampling=keep, table_start=start,
                                     history=history))  # fmt: skip
            if late:
                in_flight[s] = draw(tokens)  # known to the runner only
                outputs[s].append(in_flight[s])  # the scheduler learns it after this plan
            whole_history = (0, tuple(outputs[s]), False) if keeps else None
            whole.append(SequenceStep(s, (1,), 0, (0,), tables[s], opts is not None,
                                      sampling=opts, history=whole_history))  # fmt: skip
        if not rows:
            continue  # the scheduler actor sends no plan without sequences
        if not draw(st.booleans(), label="sent") and draw(st.booleans()):
            num_unsent += 1
            continue  # built, never sent: changes nothing on either side
        num_placeholders += len(in_flight)
        sender.sent()
        got = runner.update(rows, in_flight.copy)
        _same_resolution(got, InputBatch().update(whole))
        for s in got.seen:
            ids, counts = got.seen[s]
            assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == _expected_seen(
                prompts[s], outputs[s], reps[s]
            )
        assert sorted(runner.seq_ids()) == sorted(r.seq_id for r in rows)
        assert sorted(runner.history_ids()) == sorted(got.seen)
    event("a plan never sent" if num_unsent else "every plan sent")
    event("rows planned ahead" if num_placeholders else "no row planned ahead")
