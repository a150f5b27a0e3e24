"""The speculative tails of a block pool's sequences: the proposals an append marked
(``num_speculative_tokens``) and not yet verified by a truncation.

:class:`SpeculativeTails` is a class of its own, held by the
:class:`~asyncpaged.kv.block_pool.BlockPool`, because the tails are state with a life of
their own (opened by an append, closed by a truncation or a free) and checks of their own (no
sequence with a tail grows, forks or swaps out); the truncation itself changes the pool's
tables and blocks, so it stays a method of the pool, which asks the tails what it may keep.
"""

from __future__ import annotations

from collections.abc import ItemsView, Mapping, Sequence
from dataclasses import dataclass

from asyncpaged.errors import BlockPoolError
from asyncpaged.kv.block_table import BlockTable, Location, SeqId
from asyncpaged.kv.physical_blocks import PhysicalBlocks

__all__ = ["SpeculativeTail", "SpeculativeTails"]


@dataclass(frozen=True, slots=True)
class SpeculativeTail:
    """A sequence's unverified tokens: positions ``start ..`` its end. ``known_tokens`` are
    the tokens from ``known_start`` (the first block holding a speculative token) to the end,
    kept so that :meth:`BlockPool.truncate` can rebuild a partial last block's tokens (only with
    prefix caching; empty otherwise)."""

    start: int
    known_start: int
    known_tokens: tuple[int, ...]


class SpeculativeTails:
    """The open speculative tail of each sequence that has one (one per sequence at most).

    Invariants (:meth:`check_invariants`): each tail is of a device table, within it, covers no
    block in the prefix cache, and (with prefix caching) knows the tokens of the table's
    partial last block.
    """

    def __init__(self, block_size: int, *, caching: bool) -> None:
        self.block_size = block_size
        self.caching = caching
        self._tails: dict[SeqId, SpeculativeTail] = {}

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tails

    def get(self, seq_id: SeqId) -> SpeculativeTail | None:
        return self._tails.get(seq_id)

    def items(self) -> ItemsView[SeqId, SpeculativeTail]:
        return self._tails.items()

    def check_verified(self, seq_id: SeqId, action: str) -> None:
        """Raise unless the sequence holds no speculative tokens."""
        if seq_id in self._tails:
            raise BlockPoolError(
                f"cannot {action} sequence {seq_id!r}: it holds speculative tokens not yet "
                "verified (truncate it first)."
            )

    @staticmethod
    def check_num_speculative(num_speculative: int, num_tokens: int) -> None:
        """An append of ``num_tokens`` tokens may mark ``0 .. num_tokens`` of them speculative."""
        if not 0 <= num_speculative <= num_tokens:
            raise BlockPoolError(
                f"num_speculative_tokens must be in [0, {num_tokens}], got {num_speculative}."
            )

    def open(self, table: BlockTable, token_ids: Sequence[int], num_speculative: int) -> None:
        """Record an append's speculative tokens, before its slots are written."""
        start = table.num_tokens + len(token_ids) - num_speculative
        if not self.caching:
            tail = SpeculativeTail(start=start, known_start=start, known_tokens=())
        else:
            known_start = start - start % self.block_size
            partial_start = table.num_tokens - len(table.partial_token_ids)
            known = (*table.partial_token_ids, *token_ids)[known_start - partial_start :]
            tail = SpeculativeTail(start=start, known_start=known_start, known_tokens=known)
        self._tails[table.seq_id] = tail

    def close(self, seq_id: SeqId) -> None:
        """Forget the sequence's tail, if any (verified, or the sequence is freed)."""
        self._tails.pop(seq_id, None)

    def kept_partial_tokens(self, table: BlockTable, num_tokens: int) -> list[int]:
        """The tokens of the last block after truncating ``table`` to ``num_tokens`` (prefix
        caching); raises unless they are known (from the table's partial block or the tail)."""
        block_size = self.block_size
        num_partial = num_tokens % block_size
        if not self.caching or not num_partial:
            return []
        tail = self._tails.get(table.seq_id)
        if tail is not None:
            known_start, known = tail.known_start, tail.known_tokens
        else:
            known = tuple(table.partial_token_ids)
            known_start = table.num_tokens - len(known)
        block_start = num_tokens - num_partial
        if block_start < known_start:
            raise BlockPoolError(
                f"cannot truncate sequence {table.seq_id!r} to {num_tokens} tokens: the tokens "
                f"of that block are no longer known (truncate within its last block, its "
                f"speculative tail, or to a multiple of {block_size})."
            )
        return list(known[block_start - known_start : num_tokens - known_start])

    def check_invariants(self, device: PhysicalBlocks, tables: Mapping[SeqId, BlockTable]) -> None:
        """Assert the class invariants against the pool's ``tables`` (O(tails))."""
        bs = self.block_size
        for sid, tail in self._tails.items():
            table = tables[sid]
            assert table.location is Location.DEVICE, f"{sid!r}: speculative tail off device"
            assert tail.start <= table.num_tokens, f"{sid!r}: speculative tail past the end"
            for i in range(tail.start // bs, table.num_tokens // bs):
                assert device.hash_of(table.block_ids[i]) is None, (
                    f"{sid!r}: a block holding speculative tokens is in the prefix cache"
                )
            if self.caching:
                assert len(tail.known_tokens) == table.num_tokens - tail.known_start
                assert tail.known_start <= tail.start
                num_partial = table.num_tokens % bs
                if num_partial:
                    assert list(tail.known_tokens[-num_partial:]) == table.partial_token_ids
