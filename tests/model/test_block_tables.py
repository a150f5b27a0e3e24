"""The persistent block tables: the scheduler's deltas, applied by the runner, rebuild every
sequence's true table in every step, whatever the tables do between steps."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.worker.block_tables import BlockTables, TableDeltas


class Row(NamedTuple):
    seq_id: int
    table_start: int
    block_table: tuple[int, ...]


# What a table can do between two steps where its sequence runs.
EDITS = ("same", "append", "cow_last", "truncate", "replace", "absent")


@st.composite
def histories(draw: st.DrawFn) -> list[dict[int, tuple[int, ...]]]:
    """Plans as {seq_id: its true table}, each derived from the last by random edits."""
    num_seqs = draw(st.integers(1, 12))
    tables: dict[int, tuple[int, ...]] = {}
    plans = []
    next_block = 0
    for _ in range(draw(st.integers(1, 25))):
        plan = {}
        for seq_id in range(num_seqs):
            edit = draw(st.sampled_from(EDITS))
            table = tables.get(seq_id, ())
            if edit == "absent":
                continue
            if edit == "append" or not table:
                grow = draw(st.integers(1, 40))
                table = table + tuple(range(next_block, next_block + grow))
                next_block += grow
            elif edit == "cow_last":
                table = (*table[:-1], next_block)
                next_block += 1
            elif edit == "truncate":
                table = table[: draw(st.integers(0, len(table) - 1))] or (next_block,)
                next_block += 1
            elif edit == "replace":  # swapped back in, or recomputed: new blocks throughout
                table = tuple(range(next_block, next_block + len(table)))
                next_block += len(table)
            tables[seq_id] = table
            plan[seq_id] = table
        order = draw(st.permutations(sorted(plan)))
        plans.append({seq_id: plan[seq_id] for seq_id in order})
    return plans


@settings(max_examples=300, deadline=None)
@given(histories())
def test_deltas_rebuild_every_true_table(plans: list[dict[int, tuple[int, ...]]]) -> None:
    sender, runner = TableDeltas(), BlockTables(rows=2, width=2)  # small: both grow
    last: dict[int, tuple[int, ...]] = {}
    for plan in plans:
        if not plan:  # the scheduler actor sends no plan without sequences
            continue
        sender.start_plan()
        rows = []
        for seq_id, table in plan.items():
            start, blocks = sender.delta(seq_id, table)
            rows.append(Row(seq_id, start, blocks))
            # Only what changed travels: an unchanged or appended table keeps its old entries.
            before = last.get(seq_id)
            if before is not None and table[: len(before)] == before:
                assert (start, blocks) == (len(before), table[len(before) :])
            elif before is None:
                assert start == 0
        sender.sent()
        order, lens = runner.update(rows)
        gathered = runner.gather(order, lens)
        width = max(len(t) for t in plan.values())
        expected = np.zeros((len(plan), width), dtype=np.int64)
        for i, table in enumerate(plan.values()):
            expected[i, : len(table)] = table
        np.testing.assert_array_equal(gathered, expected)
        assert lens.tolist() == [len(t) for t in plan.values()]
        assert sorted(runner.seq_ids()) == sorted(plan)
        assert len(set(order.tolist())) == len(plan)  # distinct rows
        seen = {seq_id for p in plans for seq_id in p}
        assert runner.capacity <= max(2, 2 * len(seen))  # rows of dropped sequences reused
        last = dict(plan)


def test_a_sequence_that_missed_a_step_gets_its_whole_table() -> None:
    sender, runner = TableDeltas(), BlockTables()
    for plan in ({1: (5, 6), 2: (7,)}, {2: (7,)}, {1: (5, 6, 8), 2: (7,)}):
        sender.start_plan()
        rows = [Row(s, *sender.delta(s, t)) for s, t in plan.items()]
        sender.sent()
        runner.update(rows)
    assert rows == [Row(1, 0, (5, 6, 8)), Row(2, 1, ())]
    assert runner.table(1) == (5, 6, 8)
    assert runner.table(2) == (7,)


def test_the_runner_refuses_a_delta_it_cannot_apply() -> None:
    runner = BlockTables()
    with pytest.raises(AssertionError, match="was not in the last step"):
        runner.update([Row(1, 2, (9,))])
    runner = BlockTables()
    runner.update([Row(1, 0, (4, 5))])
    with pytest.raises(AssertionError, match="past its 2 blocks"):
        runner.update([Row(1, 3, (9,))])
    runner = BlockTables()
    with pytest.raises(AssertionError, match="appears twice"):
        runner.update([Row(1, 0, (4,)), Row(1, 0, (5,))])


def test_a_plan_built_but_not_sent_changes_nothing() -> None:
    sender, runner = TableDeltas(), BlockTables()
    sender.start_plan()
    runner.update([Row(1, *sender.delta(1, (4, 5)))])
    sender.sent()
    sender.start_plan()  # a plan that fails to build (or is never sent) ...
    assert sender.delta(1, (4, 5, 6, 7)) == (2, (6, 7))
    sender.start_plan()  # ... and the next one is relative to what the runner holds
    rows = [Row(1, *sender.delta(1, (4, 5, 6)))]
    assert rows == [Row(1, 2, (6,))]
    sender.sent()
    runner.update(rows)
    assert runner.table(1) == (4, 5, 6)
