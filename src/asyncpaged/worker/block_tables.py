"""Block tables that persist in the runner between steps; a step sends only what changed.

Both halves of the protocol live here. The scheduler actor's :class:`TableDeltas` remembers
the tables it sent in the last plan and turns each sequence's full table into
``(table_start, blocks)``: the row keeps its first ``table_start`` entries from the last step
and ``blocks`` follow them. The runner's :class:`BlockTables` applies that to its rows and
gathers the step's ``[S, max_blocks]`` array without a Python loop over the tables.

The rule both sides follow: **a table persists from one plan to the next only for sequences
in both**. A sequence absent from a plan (finished, preempted, swapped, or just not scheduled
that step) is forgotten, and its next appearance sends its whole table (``table_start`` 0).
That needs no finish or preemption messages, and it holds as long as every plan the sender
marks sent is executed, in order, by the runner (the executor runs steps one at a time; a
failed step fails the engine); a plan built but not sent changes nothing. ``table_start`` 0
is always valid, so a plan built by hand (tests, benchmarks, probes) with full tables works
on any runner.

In a decode step most sequences send ``(len, ())``: their tables gain a block only every
``block_size`` tokens. Copy-on-write replaces a table's last entry, a speculative rollback
drops entries; both show as a ``table_start`` before the old end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


class TableRow(Protocol):
    """What :meth:`BlockTables.update` reads of a step's sequence (``SequenceStep``)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def table_start(self) -> int: ...
    @property
    def block_table(self) -> tuple[int, ...]: ...


class TableDeltas:
    """The sender's side: the tables of the last plan sent, by sequence id.

    Invariant: ``_last`` holds exactly the tables of the last plan :meth:`sent`, which is the
    state of the runner's rows once it has executed that plan; ``_next`` those of the plan
    being built (a plan that is never sent changes nothing).
    """

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, ...]] = {}
        self._next: dict[int, tuple[int, ...]] = {}

    def start_plan(self) -> None:
        """Begin building a plan (dropping one built but not sent)."""
        self._next = {}

    def sent(self) -> None:
        """The plan built since :meth:`start_plan` went to the runner: its tables are what the
        runner holds next; sequences not in it are forgotten."""
        self._last, self._next = self._next, {}

    def delta(self, seq_id: int, table: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """``(table_start, blocks)`` that turn the runner's row of ``seq_id`` (as of the last
        plan sent) into ``table``."""
        self._next[seq_id] = table
        last = self._last.get(seq_id)
        if last is None:
            return 0, table
        kept = len(last)
        if table[:kept] != last:
            kept = _common_prefix(last, table)
        return kept, table[kept:]

    def __len__(self) -> int:
        return len(self._last)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class BlockTables:
    """The runner's side: one row of block ids per sequence of the last step.

    Invariants: ``_rows`` maps each sequence of the last updated step to a distinct row of
    ``_table``, whose first ``_lens[row]`` entries are that sequence's block table; every
    other row index is in ``_free``. Entries past a row's length are stale and never read.
    """

    def __init__(self, rows: int = 64, width: int = 8) -> None:
        self._table = np.zeros((rows, width), dtype=np.int64)
        self._lens = np.zeros(rows, dtype=np.int64)
        self._rows: dict[int, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def update(self, seqs: Sequence[TableRow]) -> tuple[np.ndarray, np.ndarray]:
        """Apply a step's table changes; returns the step's rows and their table lengths, in
        ``seqs`` order. Sequences of the last step absent from ``seqs`` are forgotten."""
        last, rows = self._rows, {}
        order = np.empty(len(seqs), dtype=np.int64)
        for i, s in enumerate(seqs):
            seq_id, start, blocks = s.seq_id, s.table_start, s.block_table
            row = last.pop(seq_id, None)
            if row is None:
                assert seq_id not in rows, f"sequence {seq_id} appears twice in one step"
                assert start == 0, (
                    f"sequence {seq_id}: table_start {start}, but it was not in the last step"
                )
                row = self._free.pop() if self._free else self._grow_rows()
            elif start > self._lens[row]:
                raise AssertionError(
                    f"sequence {seq_id}: table_start {start} past its {self._lens[row]} blocks"
                )
            if blocks:
                end = start + len(blocks)
                if end > self._table.shape[1]:
                    self._grow_width(end)
                self._table[row, start:end] = blocks
                self._lens[row] = end
            else:
                self._lens[row] = start
            rows[seq_id] = row
            order[i] = row
        self._free.extend(last.values())
        self._rows = rows
        return order, self._lens[order]

    def gather(self, order: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The ``[len(order), max(lens)]`` block ids of these rows (a copy), each padded with
        block 0 past its length, as ``AttentionMetadata.block_tables`` is."""
        width = int(lens.max(initial=0)) or 1
        tables = self._table[order, :width]
        tables[np.arange(width) >= lens[:, None]] = 0
        return tables

    def table(self, seq_id: int) -> tuple[int, ...]:
        """A sequence's current table (tests, diagnostics)."""
        row = self._rows[seq_id]
        return tuple(self._table[row, : self._lens[row]].tolist())

    def seq_ids(self) -> Iterable[int]:
        return self._rows.keys()

    @property
    def capacity(self) -> int:
        """Rows allocated (held or free)."""
        return len(self._lens)

    def _grow_rows(self) -> int:
        old = len(self._lens)
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
        self._lens = np.concatenate([self._lens, np.zeros_like(self._lens)])
        self._free.extend(range(2 * old - 1, old, -1))
        return old

    def _grow_width(self, width: int) -> None:
        new = max(width, 2 * self._table.shape[1])
        grown = np.zeros((self._table.shape[0], new), dtype=np.int64)
        grown[:, : self._table.shape[1]] = self._table
        self._table = grown
