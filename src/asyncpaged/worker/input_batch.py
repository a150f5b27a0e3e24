"""The runner's persistent input batch: what it keeps of each sequence between steps, so that a
step sends only what changed.

Per sequence the runner keeps three things, all in one cached state: its **block table** (a
row of one numpy array), its **sampling options** and, for a penalized row, its **penalty
history** (the distinct tokens it has seen and how often each occurs in its output). A step's
``SequenceStep`` carries only the changes:

- ``(table_start, block_table)``: keep the first ``table_start`` entries of the table, then
  ``block_table``. Most decode rows send ``(len, ())`` (a table gains a block once per
  ``block_size`` tokens); copy-on-write replaces the last entry and a speculative rollback
  drops entries, both a ``table_start`` before the old end.
- ``keep_sampling``: the row's options are the ones the runner holds (``sampling`` is None on
  the wire). A completion's options are often one object for its whole life
  (``actors.step_builder``'s fixed options), so they are pickled once, not every step.
- ``history``, ``(start, tail, late)``, for a row whose options set ``history_seq``: the runner
  holds the first ``start`` output tokens, ``tail`` follows, and with ``late`` (a row planned
  ahead of the step that samples the sequence's next token) the token that step sampled
  follows the tail, added by the runner. The options carry no output, so they stay the same
  from token to token; the penalties read the kept (ids, counts) without a pass over the
  whole history.

Both halves of the protocol live here. The scheduler actor's :class:`SentBatch` records what
the runner holds as of the last plan sent and turns each row into its changes; the runner's
:class:`InputBatch` applies a step's rows in one pass (:meth:`InputBatch.update`), returning
the rows as the runner runs them (options put back), their gathered ``[S, max_blocks]``
tables and the penalized rows' seen tokens.

The rule both sides follow: **a sequence's state persists from one plan to the next only for
sequences in both**; within that, options persist only where the first row had options, and a
penalty history only where both rows set ``history_seq``. A sequence absent from a plan
(finished, preempted, swapped, or not scheduled) is forgotten whole, in one place, and its next
row sends everything (``table_start`` 0, its options, its whole output): no finish or
preemption message is needed. That holds as long as every plan the sender marks
:meth:`SentBatch.sent` is executed, in order, by the runner (the executor runs steps one at a
time; a failed step fails the engine); a plan built but never sent changes nothing. A row with
``table_start`` 0, its options and no kept history works on any runner, so plans built by hand
(tests, benchmarks, probes) run unchanged. Rows that keep no penalty history send their whole
output in the options: parallel-sampling forks, speculative verification rows, draft-model
engines (the draft draws from the same options), requests with logits processors and beam
search. A sequence's output only grows while it runs; the sender still checks the token it
last sent before trusting that, and resends the whole output if it changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
from asyncpaged.sampling.options import SamplingOptions, SeenTokens
from asyncpaged.worker.protocol import SequenceStep


class _Sent:
    """What the runner holds of one sequence, as the sender sent it: its table (None: no row
    set it), its options object (None: none) and, for a kept penalty history, (its output
    length, its last output token, -1 for none or ``PLACEHOLDER_TOKEN`` for one planned ahead)."""

    __slots__ = ("options", "output", "table")

    def __init__(self) -> None:
        self.table: tuple[int, ...] | None = None
        self.options: SamplingOptions | None = None
        self.output: tuple[int, int] | None = None


class SentBatch:
    """The sender's side: what the runner's :class:`InputBatch` holds of each sequence as of the
    last plan sent.

    One transaction per plan: :meth:`start_plan`, then per row :meth:`table`,
    :meth:`history_start` (a row keeping its penalty history) and :meth:`options` (a row with
    options), then :meth:`sent` once the runner has the plan. Invariant: ``_last`` holds what
    the runner holds once it has executed the last plan sent; ``_next`` that of the plan being
    built (a plan never sent changes nothing).
    """

    def __init__(self) -> None:
        self._last: dict[int, _Sent] = {}
        self._next: dict[int, _Sent] = {}

    def start_plan(self) -> None:
        """Begin building a plan (dropping one built but not sent)."""
        self._next = {}

    def sent(self) -> None:
        """The plan built since :meth:`start_plan` went to the runner: its rows are what the
        runner holds next; sequences not in it are forgotten."""
        self._last, self._next = self._next, {}

    def _row(self, seq_id: int) -> _Sent:
        row = self._next.get(seq_id)
        if row is None:
            row = self._next[seq_id] = _Sent()
        return row

    def table(self, seq_id: int, table: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """``(table_start, blocks)`` that turn the runner's table of ``seq_id`` (as of the last
        plan sent) into ``table``."""
        self._row(seq_id).table = table
        held = self._last.get(seq_id)
        last = None if held is None else held.table
        if last is None:
            return 0, table
        kept = len(last)
        if table[:kept] != last:
            kept = _common_prefix(last, table)
        return kept, table[kept:]

    def options(
        self, seq_id: int, options: SamplingOptions | None
    ) -> tuple[SamplingOptions | None, bool]:
        """``(sampling, keep_sampling)`` for the row of ``seq_id`` whose options are
        ``options``: ``(None, True)`` where the runner holds this very object already."""
        if options is None:
            return None, False
        self._row(seq_id).options = options
        held = self._last.get(seq_id)
        if held is not None and held.options is options:
            return None, True
        return options, False

    def history_start(
        self, seq_id: int, token_ids: Sequence[int], num_prompt: int, *, late: bool = False
    ) -> int:
        """How many leading output tokens of a sequence (``token_ids``: its prompt's
        ``num_prompt`` tokens, then its output) the runner's penalty history holds from the
        last plan sent: the row then sends the output from there on. ``late``: the row is
        planned ahead of the step that samples the sequence's next token, which the runner
        adds after the row's tail (``SequenceStep.history``'s ``late``); its value is not
        known here."""
        num_output = len(token_ids) - num_prompt
        row = self._row(seq_id)
        if late:
            row.output = (num_output + 1, PLACEHOLDER_TOKEN)
        else:
            row.output = (num_output, token_ids[-1] if num_output else -1)
        held = self._last.get(seq_id)
        if held is None or held.output is None:
            return 0
        length, token = held.output
        if length > num_output:
            return 0  # not an extension of what was sent (cannot happen while it runs)
        if length and token != PLACEHOLDER_TOKEN and token_ids[num_prompt + length - 1] != token:
            return 0
        return length


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


_SAMPLING = SequenceStep._fields.index("sampling")
_KEEP_SAMPLING = SequenceStep._fields.index("keep_sampling")


class ResolvedRows(NamedTuple):
    """A step's rows as the runner runs them (:meth:`InputBatch.update`)."""

    seqs: tuple[SequenceStep, ...]  # the rows, kept options put back (the same tuple if none)
    num_blocks: np.ndarray  # [S] int64: each row's table length
    tables: np.ndarray  # [S, max(num_blocks)] int64 block ids, padded with block 0
    seen: dict[int, SeenTokens]  # by sequence: the seen tokens of each kept penalty history


class _History:
    """One sequence's seen tokens: ``ids[:size]`` distinct, ``counts[:size]`` their output
    occurrences (float32, exact below 2**24; 0 for a prompt-only token), ``index`` each id's
    position, ``num_output`` the output tokens counted."""

    __slots__ = ("counts", "ids", "index", "num_output", "size")

    def __init__(self, prompt: Sequence[int]) -> None:
        distinct = list(dict.fromkeys(prompt))
        size = len(distinct)
        capacity = max(16, 2 * size)
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.ids[:size] = distinct
        self.counts = np.zeros(capacity, dtype=np.float32)
        self.index = {t: i for i, t in enumerate(distinct)}
        self.size = size
        self.num_output = 0

    def extend(self, tokens: Sequence[int]) -> None:
        index, counts = self.index, self.counts
        for t in tokens:
            i = index.get(t)
            if i is None:
                i = index[t] = self.size
                if i == len(self.ids):
                    self._grow()
                    counts = self.counts
                self.ids[i] = t
                self.size += 1
            counts[i] += 1
        self.num_output += len(tokens)

    def _grow(self) -> None:
        capacity = 2 * len(self.ids)
        ids = np.zeros(capacity, dtype=np.int64)
        ids[: self.size] = self.ids[: self.size]
        counts = np.zeros(capacity, dtype=np.float32)
        counts[: self.size] = self.counts[: self.size]
        self.ids, self.counts = ids, counts

    def seen(self) -> SeenTokens:
        """(distinct token ids int64, their output counts float32): views, valid until the next
        :meth:`extend`."""
        return self.ids[: self.size], self.counts[: self.size]


class _Cached:
    """One sequence's state in the runner: its ``row`` of the table array, the ``options`` its
    last row ran with (None: none) and its kept penalty ``history`` (None: none)."""

    __slots__ = ("history", "options", "row")

    def __init__(self, row: int) -> None:
        self.row = row
        self.options: SamplingOptions | None = None
        self.history: _History | None = None


class InputBatch:
    """The runner's side: a :class:`_Cached` state per sequence of the last step.

    Invariants: ``_seqs`` maps each sequence of the last updated step to its state, whose
    ``row`` is a distinct row of ``_table`` holding that sequence's block table in its first
    ``_lens[row]`` entries (entries past it are stale and never read), whose ``options`` are
    those its row ran with, and whose ``history`` counts its prompt (where its repetition
    penalty is not 1) and whole output up to the step's token, where that row set
    ``history_seq``; every other row index of ``_table`` is in ``_free``.
    """

    def __init__(self, rows: int = 64, width: int = 8) -> None:
        self._table = np.zeros((rows, width), dtype=np.int64)
        self._lens = np.zeros(rows, dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))
        self._seqs: dict[int, _Cached] = {}

    def update(
        self,
        seqs: Sequence[SequenceStep],
        placeholder_values: Callable[[], dict[int, int]] = dict,
    ) -> ResolvedRows:
        """Apply a step's rows, in one pass: each row's table changes, kept options and penalty
        history tail. Sequences of the last step absent from ``seqs`` are forgotten (their
        table rows are reused). ``placeholder_values()``: the token the last step sampled, by
        sequence, for the rows whose ``history`` is late."""
        last, cached = self._seqs, {}
        order = np.empty(len(seqs), dtype=np.int64)
        out: list[SequenceStep] | None = None  # a copy of seqs once a row changes
        seen: dict[int, SeenTokens] = {}
        late: dict[int, int] | None = None
        lens = self._lens  # (rebound where the table grows)
        for i, s in enumerate(seqs):
            seq_id, start, blocks = s.seq_id, s.table_start, s.block_table
            state = last.pop(seq_id, None)
            if state is None:
                assert seq_id not in cached, f"sequence {seq_id} appears twice in one step"
                assert start == 0, (
                    f"sequence {seq_id}: table_start {start}, but it was not in the last step"
                )
                state = _Cached(self._free.pop() if self._free else self._grow_rows())
                lens = self._lens
            row = state.row
            if start > lens[row]:
                raise AssertionError(
                    f"sequence {seq_id}: table_start {start} past its {lens[row]} blocks"
                )
            if blocks:
                end = start + len(blocks)
                if end > self._table.shape[1]:
                    self._grow_width(end)
                self._table[row, start:end] = blocks
                lens[row] = end
            else:
                lens[row] = start
            if s.keep_sampling:
                assert state.options is not None, f"sequence {seq_id} keeps options it never sent"
                if out is None:
                    out = list(seqs)
                fields = list(s)  # (``_replace`` costs 3x as much per row)
                fields[_SAMPLING], fields[_KEEP_SAMPLING] = state.options, False
                out[i] = tuple.__new__(SequenceStep, fields)
            else:
                state.options = s.sampling
            opt = state.options
            if opt is None or opt.history_seq is None:
                state.history = None
            else:
                history = self._extend_history(s, opt, state.history)
                if s.history is not None and s.history[2]:
                    late = placeholder_values() if late is None else late
                    assert seq_id in late, f"sequence {seq_id}: a placeholder, none sampled last"
                    history.extend((late[seq_id],))
                state.history = history
                seen[seq_id] = history.seen()
            cached[seq_id] = state
            order[i] = row
        self._free.extend(state.row for state in last.values())
        self._seqs = cached
        num_blocks = lens[order]
        return ResolvedRows(
            seqs=tuple(seqs) if out is None else tuple(out),
            num_blocks=num_blocks,
            tables=self._gather(order, num_blocks),
            seen=seen,
        )

    @staticmethod
    def _extend_history(
        s: SequenceStep, opt: SamplingOptions, history: _History | None
    ) -> _History:
        """The penalty history of a row keeping one, with the row's tail added."""
        assert opt.history_seq == s.seq_id, (
            f"sequence {s.seq_id} carries the penalty history of {opt.history_seq}"
        )
        assert s.history is not None, f"sequence {s.seq_id}: a kept history, no delta"
        start, tail, _ = s.history
        if start == 0:
            history = _History(opt.prompt_token_ids if opt.repetition_penalty != 1.0 else ())
        elif history is None or history.num_output != start:
            held = None if history is None else history.num_output
            raise AssertionError(
                f"sequence {s.seq_id}: history start {start}, but the runner holds {held} "
                "output tokens of it"
            )
        history.extend(tail)
        return history

    def _gather(self, order: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The ``[len(order), max(lens)]`` block ids of these rows (a copy), each padded with
        block 0 past its length, as ``AttentionMetadata.block_tables`` is."""
        width = int(lens.max(initial=0)) or 1
        tables = self._table[order, :width]
        tables[np.arange(width) >= lens[:, None]] = 0
        return tables

    def table(self, seq_id: int) -> tuple[int, ...]:
        """A sequence's current table (tests, diagnostics)."""
        row = self._seqs[seq_id].row
        return tuple(self._table[row, : self._lens[row]].tolist())

    def options_of(self, seq_id: int) -> SamplingOptions | None:
        """The options a sequence's row ran with in the last step (None: none, or absent)."""
        state = self._seqs.get(seq_id)
        return None if state is None else state.options

    def history_ids(self) -> Iterable[int]:
        """The sequences whose penalty history the batch keeps (tests, diagnostics)."""
        return (seq_id for seq_id, state in self._seqs.items() if state.history is not None)

    def seq_ids(self) -> Iterable[int]:
        return self._seqs.keys()

    @property
    def capacity(self) -> int:
        """Table rows allocated (held or free)."""
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
