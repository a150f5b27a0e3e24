"""The allocator actor: owns the block pool and applies one transaction per step."""

from __future__ import annotations

from collections.abc import Callable

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpaged._log import get_logger
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import PoolStatistics
from asyncpaged.kv.prefix_hash import BlockHash
from asyncpaged.kv.txn import PoolSnapshot, StepTxn, TxnResult, apply_txn, snapshot

log = get_logger(__name__)


class AllocatorActor:
    """Receives :class:`StepTxn` and replies with :class:`TxnResult`, strictly one at a time.

    The scheduler sends a transaction and waits for its result before sending the next, so the
    reply stream needs a buffer of one and the two never block each other.
    """

    def __init__(
        self,
        pool: BlockPool,
        inbox: MemoryObjectReceiveStream[StepTxn],
        replies: MemoryObjectSendStream[TxnResult],
        failed_spills: Callable[[], list[BlockHash]] | None = None,
    ) -> None:
        """``failed_spills``: the KV-tier store's drain of disk writes that failed; those
        entries are forgotten before each transaction, so no lookup can restore them."""
        self.pool = pool
        self._failed_spills = failed_spills
        self._inbox = inbox
        self._replies = replies
        self._log = log.bind(actor="allocator")

    def snapshot(self) -> PoolSnapshot:
        return snapshot(self.pool)

    def statistics(self) -> PoolStatistics:
        return self.pool.statistics()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Apply transactions until the inbox closes. Cancellation between messages is safe:
        a transaction is applied synchronously, all or nothing."""
        task_status.started()
        async with self._inbox, self._replies:
            async for txn in self._inbox:
                if self._failed_spills is not None:
                    self.pool.begin_tier_txn(self._failed_spills())
                result = apply_txn(self.pool, txn)
                if result.swap_outs:
                    self._log.debug("blocks_swapped_out", num_swaps=len(result.swap_outs))
                await self._replies.send(result)
