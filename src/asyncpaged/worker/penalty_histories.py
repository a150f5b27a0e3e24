"""Penalty histories that persist in the runner between steps; a step sends only new tokens.

The repetition, frequency and presence penalties read every token a row has seen: its prompt
(repetition only) and its output so far. Sent whole, that history costs every penalized row a
copy of its output per step on the scheduler's side and a flattening and sort of every history
on the runner's (``logits_processors.penalize_rows_``), both growing with the output. Here the
runner keeps, per sequence, the distinct tokens it has seen and how often each occurs in its
output, and each step adds only the tokens that came since.

Both halves of the protocol live here, as in ``block_tables``. The scheduler actor's
:class:`HistoryDeltas` remembers the output length (and last token) each sequence had in the
last plan sent and turns a row's output into ``SequenceStep.history``, ``(start, tail,
late)``: the runner holds the first ``start`` output tokens, ``tail`` follows them, and with
``late`` (a row planned ahead of the step that samples the sequence's next token) the token
that step sampled follows the tail, added by the runner. The row's ``SamplingOptions`` carry
no output, so a request's options stay the same from token to token (and are sent once,
``kept_options``). The runner's :class:`PenaltyHistories` applies the delta and hands
``penalize_rows_`` each row's seen tokens and counts, without a pass over the whole history.

The rule both sides follow: **a history persists from one plan to the next only for sequences
with a persistent row (``SamplingOptions.history_seq`` set) in both**. Any other plan forgets
it, and the sequence's next persistent row starts over (start 0, the whole output as the
tail). Rows that stay whole: parallel-sampling fan-outs, speculative verification rows,
draft-model engines (the draft draws from the same options), requests with logits processors
(they read the output as a list) and beam search. A sequence's output only grows while it runs;
the sender also checks the token it last sent before trusting that, and resends whole if it
changed. As with the tables, this holds as long as every plan marked sent is executed, in
order, by the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from asyncpaged.kv.block_table import LATE_TOKEN
from asyncpaged.sampling.options import SeenTokens

if TYPE_CHECKING:
    from asyncpaged.worker.protocol import SequenceStep


class HistoryDeltas:
    """The sender's side: each persistent sequence's output as of the last plan sent.

    Invariant: ``_last`` maps each sequence with a persistent row in the last plan
    :meth:`sent` to (its output length, its last output token or -1), which is what the
    runner's history of it holds once it has executed that plan; ``_next`` the same for the
    plan being built (a plan that is never sent changes nothing).
    """

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}
        self._next: dict[int, tuple[int, int]] = {}

    def start_plan(self) -> None:
        """Begin building a plan (dropping one built but not sent)."""
        self._next = {}

    def sent(self) -> None:
        """The plan built since :meth:`start_plan` went to the runner."""
        self._last, self._next = self._next, {}

    def start(
        self, seq_id: int, token_ids: Sequence[int], num_prompt: int, *, late: bool = False
    ) -> int:
        """How many leading output tokens of a sequence (``token_ids``: its prompt's
        ``num_prompt`` tokens, then its output) the runner holds from the last plan sent: the
        row then sends the output from there on. ``late``: the row is planned ahead of the
        step that samples the sequence's next token, which the runner adds after the row's
        tail (``SequenceStep.history``'s ``late``); its value is not known here (-1)."""
        num_output = len(token_ids) - num_prompt
        if late:
            self._next[seq_id] = (num_output + 1, LATE_TOKEN)
        else:
            self._next[seq_id] = (num_output, token_ids[-1] if num_output else -1)
        held = self._last.get(seq_id)
        if held is None:
            return 0
        length, token = held
        if length > num_output:
            return 0  # not an extension of what was sent (cannot happen while it runs)
        if length and token != LATE_TOKEN and token_ids[num_prompt + length - 1] != token:
            return 0
        return length


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

    def seen(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct token ids int64, their output counts float32): views, valid until the next
        :meth:`extend`."""
        return self.ids[: self.size], self.counts[: self.size]


class PenaltyHistories:
    """The runner's side: a :class:`_History` per sequence with a persistent row in the last
    step.

    Invariant: ``_rows`` holds exactly the sequences whose row in the last step set
    ``history_seq``, each history counting that row's prompt (where its repetition penalty
    is not 1) and its whole output up to the step's token.
    """

    def __init__(self) -> None:
        self._rows: dict[int, _History] = {}

    def update(
        self, seqs: Sequence[SequenceStep], late_tokens: Callable[[], dict[int, int]]
    ) -> dict[int, SeenTokens]:
        """Apply a step's rows; returns the seen tokens of each persistent row's sequence.
        Histories of sequences without a persistent row in ``seqs`` are forgotten.
        ``late_tokens()``: the token the last step sampled, by sequence, for the rows whose
        ``history`` is late."""
        last, rows = self._rows, {}
        late: dict[int, int] | None = None
        for s in seqs:
            opt = s.sampling
            if opt is None or opt.history_seq is None:
                continue
            assert opt.history_seq == s.seq_id, (
                f"sequence {s.seq_id} carries the penalty history of {opt.history_seq}"
            )
            assert s.history is not None, f"sequence {s.seq_id}: a kept history, no delta"
            start, tail, is_late = s.history
            history = last.pop(s.seq_id, None)
            if start == 0:
                repeated = opt.repetition_penalty != 1.0
                history = _History(opt.prompt_token_ids if repeated else ())
            elif history is None or history.num_output != start:
                held = None if history is None else history.num_output
                raise AssertionError(
                    f"sequence {s.seq_id}: history start {start}, but the runner holds "
                    f"{held} output tokens of it"
                )
            history.extend(tail)
            if is_late:
                late = late_tokens() if late is None else late
                assert s.seq_id in late, f"sequence {s.seq_id}: a late token, none sampled last"
                history.extend((late[s.seq_id],))
            rows[s.seq_id] = history
        self._rows = rows
        return {seq_id: h.seen() for seq_id, h in rows.items()}

    def __len__(self) -> int:
        return len(self._rows)
