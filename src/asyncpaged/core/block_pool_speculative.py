"""Speculative tails and truncation in the block pool: the record that an append with
``num_speculative_tokens`` leaves (where the unverified tokens start, and the tokens needed to
rebuild a partial last block), the refusal to grow, fork or swap a sequence holding one,
dropping a device table's tail, and the tails' invariants.

Functions of the device pool and the tables and tails they are given; the
:class:`~asyncpaged.core.block_pool.BlockPool` keeps the tails, one per sequence at most.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from asyncpaged.core.block_pool_checks import check_settled
from asyncpaged.core.block_pool_prefix import register_full_blocks
from asyncpaged.core.block_pool_write import set_filled
from asyncpaged.core.block_table import BlockTable, Location, SeqId
from asyncpaged.core.physical_blocks import PhysicalBlocks
from asyncpaged.errors import BlockPoolError


@dataclass(frozen=True, slots=True)
class SpeculativeTail:
    """A sequence's unverified tokens: positions ``start ..`` its end. ``known_tokens`` are
    the tokens from ``known_start`` (the first block holding a speculative token) to the end,
    kept so that :meth:`BlockPool.truncate` can rebuild a partial last block's tokens (only with
    prefix caching; empty otherwise)."""

    start: int
    known_start: int
    known_tokens: tuple[int, ...]


def check_verified(speculative: Container[SeqId], seq_id: SeqId, action: str) -> None:
    """Raise unless the sequence holds no speculative tokens."""
    if seq_id in speculative:
        raise BlockPoolError(
            f"cannot {action} sequence {seq_id!r}: it holds speculative tokens not yet "
            "verified (truncate it first)."
        )


def speculative_tail(
    table: BlockTable,
    token_ids: Sequence[int],
    num_speculative: int,
    block_size: int,
    caching: bool,
) -> SpeculativeTail:
    """The record of an append's speculative tokens, taken before its slots are written."""
    start = table.num_tokens + len(token_ids) - num_speculative
    if not caching:
        return SpeculativeTail(start=start, known_start=start, known_tokens=())
    known_start = start - start % block_size
    partial_start = table.num_tokens - len(table.partial_token_ids)
    known = (*table.partial_token_ids, *token_ids)[known_start - partial_start :]
    return SpeculativeTail(start=start, known_start=known_start, known_tokens=known)


def kept_partial_tokens(
    table: BlockTable,
    tail: SpeculativeTail | None,
    num_tokens: int,
    *,
    block_size: int,
    caching: bool,
) -> list[int]:
    """The tokens of the last block after truncating to ``num_tokens`` (prefix caching);
    raises unless they are known (from the table's partial block or the tail)."""
    num_partial = num_tokens % block_size
    if not caching or not num_partial:
        return []
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


def truncate_table(
    device: PhysicalBlocks,
    table: BlockTable,
    num_tokens: int,
    speculative: dict[SeqId, SpeculativeTail],
    forked: set[SeqId],
    *,
    caching: bool,
) -> tuple[int, ...]:
    """Cut a device table (and its hash chain) to its first ``num_tokens`` tokens and end its
    tail in ``speculative``; returns the blocks released, in table order. Raises, changing
    nothing, for a late last token, for ``num_tokens`` outside ``1 ..`` its length, or unless
    :func:`kept_partial_tokens` knows the new last block's tokens. With a tail, the full
    blocks its kept tokens complete are registered. A table left sharing its partial last
    block is added to ``forked``."""
    check_settled(table, "truncate", caching=caching)
    check_truncate(table, num_tokens)
    tail = speculative.get(table.seq_id)
    bs = device.block_size
    partial = kept_partial_tokens(table, tail, num_tokens, block_size=bs, caching=caching)
    keep = -(-num_tokens // bs)
    dropped = tuple(table.block_ids[keep:])
    del table.block_ids[keep:]
    device.release(dropped)
    if num_tokens % bs:
        _truncate_last_block(device, table, num_tokens, forked)
    table.num_tokens = num_tokens
    if caching:
        del table.block_hashes[num_tokens // bs :]
        table.partial_token_ids = partial
        if tail is not None:  # the kept proposals are verified: cache their full blocks
            register_full_blocks(device, table, tail.start // bs)
    speculative.pop(table.seq_id, None)
    return dropped


def _truncate_last_block(
    device: PhysicalBlocks, table: BlockTable, num_tokens: int, forked: set[SeqId]
) -> None:
    """The last block after truncating into it: an exclusive one forgets the dropped slots;
    a shared one keeps them for its other holders and is copied on this table's next append
    (it was never registered: :func:`kept_partial_tokens` only admits blocks that are
    partial or hold speculative tokens)."""
    block = table.block_ids[-1]
    assert device.hash_of(block) is None, f"truncated into cached block {block}"
    if device.ref_cnt[block] > 1:
        forked.add(table.seq_id)
        return
    set_filled(device, block, num_tokens % device.block_size)


def check_speculative_tails(
    device: PhysicalBlocks,
    tables: Mapping[SeqId, BlockTable],
    speculative: Mapping[SeqId, SpeculativeTail],
    *,
    caching: bool,
) -> None:
    """Assert the tails' invariants: each is of a device table, within it, holds no cached
    block, and (with prefix caching) knows the tokens of its partial last block."""
    bs = device.block_size
    for sid, tail in speculative.items():
        table = tables[sid]
        assert table.location is Location.DEVICE, f"{sid!r}: speculative tail off device"
        assert tail.start <= table.num_tokens, f"{sid!r}: speculative tail past the end"
        for i in range(tail.start // bs, table.num_tokens // bs):
            assert device.hash_of(table.block_ids[i]) is None, (
                f"{sid!r}: a block holding speculative tokens is in the prefix cache"
            )
        if caching:
            assert len(tail.known_tokens) == table.num_tokens - tail.known_start
            assert tail.known_start <= tail.start
            num_partial = table.num_tokens % bs
            if num_partial:
                assert list(tail.known_tokens[-num_partial:]) == table.partial_token_ids


def check_num_speculative(num_speculative: int, num_tokens: int) -> None:
    """An append of ``num_tokens`` tokens may mark ``0 .. num_tokens`` of them speculative."""
    if not 0 <= num_speculative <= num_tokens:
        raise BlockPoolError(
            f"num_speculative_tokens must be in [0, {num_tokens}], got {num_speculative}."
        )


def check_truncate(table: BlockTable, num_tokens: int) -> None:
    """A truncation keeps ``1 ..`` the table's length tokens."""
    if not 1 <= num_tokens <= table.num_tokens:
        raise BlockPoolError(
            f"cannot truncate sequence {table.seq_id!r} to {num_tokens} tokens: it has "
            f"{table.num_tokens} (keep at least 1)."
        )
