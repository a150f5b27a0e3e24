"""The exception tree of asyncpaged.

AsyncPagedError
 +-- BlockPoolError (also ValueError): a call the block pool refuses (unknown sequence,
     duplicate id, operation on a sequence in the wrong place); the pool is left unchanged.
"""

from __future__ import annotations


class AsyncPagedError(Exception):
    """Base class of every exception raised by asyncpaged."""


class BlockPoolError(AsyncPagedError, ValueError):
    """A block-pool call that is not valid in the pool's current state.

    Raised before anything changes: the pool is exactly as it was before the call.
    """
