"""The checks a block pool call makes before it changes anything, each raising
:class:`~asyncpaged.errors.BlockPoolError`: the sequence's table exists (and is on the device,
for a call that needs it there), a token list is not empty, and a table's last token is not a
late one still waiting for its value (:meth:`BlockPool.set_late_token`); and the sizes a new
pool is given (``ValueError``: user input). The speculative tails' checks are in
core/block_pool_speculative.py.

Functions of the tables they are given (the :class:`~asyncpaged.core.block_pool.BlockPool`
passes its own); nothing here changes state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from asyncpaged.core.block_table import LATE_TOKEN, BlockTable, Location, SeqId
from asyncpaged.errors import BlockPoolError


def table_of(tables: Mapping[SeqId, BlockTable], seq_id: SeqId) -> BlockTable:
    """The sequence's table; raises for an unknown sequence."""
    table = tables.get(seq_id)
    if table is None:
        raise BlockPoolError(f"unknown sequence {seq_id!r}.")
    return table


def device_table(tables: Mapping[SeqId, BlockTable], seq_id: SeqId, action: str) -> BlockTable:
    """The sequence's table; raises unless it is on the device (``action``: what the call would
    do to the sequence, for the message)."""
    table = table_of(tables, seq_id)
    if table.location is not Location.DEVICE:
        raise BlockPoolError(
            f"cannot {action} sequence {seq_id!r}: it is {table.location.value}, not on device."
        )
    return table


def check_settled(table: BlockTable, action: str, *, caching: bool) -> None:
    """A sequence waiting for its late token's value cannot change otherwise (the pool knows
    a late token only with prefix ``caching``)."""
    if caching and table.partial_token_ids[-1:] == [LATE_TOKEN]:
        raise BlockPoolError(
            f"cannot {action} sequence {table.seq_id!r}: its last token is late "
            "(set_late_token first)."
        )


def check_tokens(token_ids: Sequence[int]) -> None:
    """A call's token list is not empty."""
    if len(token_ids) == 0:
        raise BlockPoolError("token_ids must not be empty.")


def check_sizes(num_device_blocks: int, num_host_blocks: int, block_size: int) -> None:
    """A new pool has a device block, no negative host pool, and blocks of a token or more."""
    if num_device_blocks < 1 or num_host_blocks < 0 or block_size < 1:
        raise ValueError(
            f"need num_device_blocks >= 1, num_host_blocks >= 0 and block_size >= 1, got "
            f"{num_device_blocks}, {num_host_blocks} and {block_size}."
        )
