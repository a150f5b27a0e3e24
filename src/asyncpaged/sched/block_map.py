"""A read-only snapshot of every physical block: who holds it, and in which state.

``build_block_map(pool, requests)`` walks the pool once (O(device + host blocks + table
entries)) and changes nothing. Each block is in exactly one :class:`BlockState`::

    free      no holder, not in the prefix cache (or never used yet)
    cached    no holder, findable by the prefix cache (evictable, least recently used first)
    used      held by block tables and/or pinned prefixes
    swapping  the source or destination of a swap copy in flight (also held)

``ref_cnt`` counts every holder (tables, pins, copies in flight); ``holders`` names the requests
whose tables hold the block (``"pin:<id>"`` for a pinned prefix, ``"seq:<id>"`` for the table of
a sequence whose request already finished and whose free is pending).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import SeqId
from asyncpaged.kv.physical_blocks import PhysicalBlocks
from asyncpaged.sched.request import Request

__all__ = [
    "BlockInfo",
    "BlockMap",
    "BlockState",
    "PoolBlockMap",
    "RequestBlocks",
    "build_block_map",
]


class BlockState(enum.Enum):
    FREE = "free"
    CACHED = "cached"
    USED = "used"
    SWAPPING = "swapping"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockInfo:
    """One block of a :class:`PoolBlockMap` (see :meth:`PoolBlockMap.block`)."""

    block_id: int
    state: BlockState
    ref_cnt: int
    num_filled: int  # slots written (as of the last transaction)
    holders: tuple[str, ...]
    num_copies_in_flight: int

    @property
    def is_shared(self) -> bool:
        return self.ref_cnt > 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolBlockMap:
    """One pool (device or host), column-wise: entry ``i`` of each tuple is block ``i``.

    ``holders`` and ``in_flight`` list only the blocks that have any.
    """

    num_blocks: int
    states: tuple[BlockState, ...]
    ref_cnt: tuple[int, ...]
    num_filled: tuple[int, ...]
    holders: Mapping[int, tuple[str, ...]]
    in_flight: Mapping[int, int]  # block -> copies in flight

    def block(self, block_id: int) -> BlockInfo:
        return BlockInfo(
            block_id=block_id,
            state=self.states[block_id],
            ref_cnt=self.ref_cnt[block_id],
            num_filled=self.num_filled[block_id],
            holders=self.holders.get(block_id, ()),
            num_copies_in_flight=self.in_flight.get(block_id, 0),
        )

    def count(self, state: BlockState) -> int:
        return self.states.count(state)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestBlocks:
    """A request the scheduler knows, and the distinct blocks its live tables hold."""

    request_id: str
    status: str  # RequestStatus value: waiting, running, swapping_out, swapped, ...
    num_seqs: int  # sequences with a block table
    num_device_blocks: int
    num_host_blocks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockMap:
    """Every device and host block, and the requests holding them (``engine.block_map()``)."""

    block_size: int
    device: PoolBlockMap
    host: PoolBlockMap
    requests: tuple[RequestBlocks, ...]
    pins: Mapping[int, tuple[int, ...]]  # pool pin id -> its device blocks


def build_block_map(pool: BlockPool, requests: Iterable[Request]) -> BlockMap:
    """Snapshot ``pool``; ``requests`` (the scheduler's) name the owners of the tables."""
    owner: dict[SeqId, str] = {}
    request_list = list(requests)
    for request in request_list:
        for seq in request.seqs:
            owner[seq.seq_id] = request.request_id
    device_holders: dict[int, list[str]] = {}
    host_holders: dict[int, list[str]] = {}
    per_request: dict[str, tuple[set[int], set[int], int]] = {}
    for seq_id, table in pool.tables().items():
        name = owner.get(seq_id, f"seq:{seq_id}")
        on_host = table.location.on_host
        holders = host_holders if on_host else device_holders
        for block in table.block_ids:
            names = holders.setdefault(block, [])
            if name not in names:
                names.append(name)
        dev, host, num_seqs = per_request.get(name, (set(), set(), 0))
        (host if on_host else dev).update(table.block_ids)
        per_request[name] = (dev, host, num_seqs + 1)
    pins = dict(pool.pins())
    for pin_id, blocks in pins.items():
        for block in blocks:
            device_holders.setdefault(block, []).append(f"pin:{pin_id}")
    summaries = []
    for request in request_list:
        dev, host, num_seqs = per_request.get(request.request_id, (set(), set(), 0))
        summaries.append(
            RequestBlocks(request_id=request.request_id, status=request.status.value,
                          num_seqs=num_seqs, num_device_blocks=len(dev),
                          num_host_blocks=len(host))
        )  # fmt: skip
    return BlockMap(
        block_size=pool.block_size,
        device=_pool_map(pool.device, device_holders),
        host=_pool_map(pool.host, host_holders),
        requests=tuple(summaries),
        pins=pins,
    )


def _pool_map(blocks: PhysicalBlocks, holders: Mapping[int, list[str]]) -> PoolBlockMap:
    ref_cnt = tuple(blocks.ref_cnt)
    in_flight = dict(blocks.in_flight)
    states = []
    for block, refs in enumerate(ref_cnt):
        if block in in_flight:
            states.append(BlockState.SWAPPING)
        elif refs:
            states.append(BlockState.USED)
        elif blocks.hash_of(block) is not None:
            states.append(BlockState.CACHED)
        else:
            states.append(BlockState.FREE)
    return PoolBlockMap(
        num_blocks=blocks.num_blocks,
        states=tuple(states),
        ref_cnt=ref_cnt,
        # a free block's count is stale (take() resets it): report 0
        num_filled=tuple(n if s is not BlockState.FREE else 0
                         for n, s in zip(blocks.num_filled, states, strict=True)),
        holders={b: tuple(names) for b, names in holders.items()},
        in_flight=in_flight,
    )  # fmt: skip
