"""Chained block hashes for the automatic prefix cache.

A full block's key depends on every token before it, so equal keys mean equal prefixes::

    hash(block i) = sha256( hash(block i-1) | extra key | token ids of block i )
    hash(block -1) = 32 zero bytes

The extra key (a tenant salt, for example) is length-prefixed and the token ids are packed as
little-endian int64, so no two different inputs share an encoding.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(32)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_key: str | None) -> BlockHash:
    """The chained hash of one full block whose predecessor hashed to ``parent``."""
    h = hashlib.sha256(parent)
    if extra_key is None:
        h.update(b"\x00")
    else:
        extra = extra_key.encode()
        h.update(b"\x01" + len(extra).to_bytes(8, "little") + extra)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, extra_key: str | None, num_blocks: int
) -> list[BlockHash]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``."""
    hashes: list[BlockHash] = []
    parent = ROOT_HASH
    for i in range(num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        hashes.append(parent)
    return hashes
