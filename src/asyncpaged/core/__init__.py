"""Synchronous, pure-Python cores: no torch, no anyio. The actors wrap them."""

from asyncpaged.core.block_pool import BlockPool
from asyncpaged.core.block_table import (
    AppendResult,
    BlockTable,
    Location,
    PinnedPrefix,
    PoolStatistics,
    PoolUsage,
    PrefixHit,
    SeqAllocation,
    SeqId,
    SwapDirection,
    SwapPlan,
)
from asyncpaged.core.prefix_hash import BlockHash, hash_block

__all__ = [
    "AppendResult",
    "BlockHash",
    "BlockPool",
    "BlockTable",
    "Location",
    "PinnedPrefix",
    "PoolStatistics",
    "PoolUsage",
    "PrefixHit",
    "SeqAllocation",
    "SeqId",
    "SwapDirection",
    "SwapPlan",
    "hash_block",
]
