"""The block pool's invariants, recomputed from scratch (O(pool); used by tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from asyncpaged.core.block_table import (
    LATE_TOKEN,
    BlockTable,
    Location,
    SeqId,
    SwapDirection,
    SwapPlan,
)
from asyncpaged.core.prefix_hash import ROOT_HASH

if TYPE_CHECKING:
    from asyncpaged.core.block_pool import BlockPool


def check_block_pool(
    pool: BlockPool,
    tables: Mapping[SeqId, BlockTable],
    pins: Mapping[int, tuple[int, ...]],
    swaps: Sequence[SwapPlan],
) -> None:
    bs = pool.block_size
    device_refs = [0] * pool.device.num_blocks
    host_refs = [0] * pool.host.num_blocks
    swapping: set[SeqId] = set()
    for plan in swaps:
        out = plan.direction is SwapDirection.OUT
        src, dst = (device_refs, host_refs) if out else (host_refs, device_refs)
        for s, d in plan.block_mapping:
            src[s] += 1
            dst[d] += 1
        swapping.update(plan.seq_ids)
    for block_ids in pins.values():
        for b in block_ids:
            device_refs[b] += 1
    for seq_id, table in tables.items():
        assert table.seq_id == seq_id
        assert len(table.block_ids) == -(-table.num_tokens // bs), f"{seq_id!r}: table length"
        assert len(set(table.block_ids)) == len(table.block_ids), f"{seq_id!r}: repeated block"
        if table.location in (Location.SWAPPING_IN, Location.SWAPPING_OUT):
            assert seq_id in swapping, f"{seq_id!r} is {table.location.value} without a swap"
        refs = host_refs if table.location.on_host else device_refs
        for b in table.block_ids:
            refs[b] += 1
        _check_hashes(pool, table)
    pool.device.check_invariants(device_refs)
    pool.host.check_invariants(host_refs)
    in_flight_dev = dict.fromkeys(pool.device.in_flight, 0)
    in_flight_host = dict.fromkeys(pool.host.in_flight, 0)
    for plan in swaps:
        out = plan.direction is SwapDirection.OUT
        src_count, dst_count = (
            (in_flight_dev, in_flight_host) if out else (in_flight_host, in_flight_dev)
        )
        for s, d in plan.block_mapping:
            src_count[s] += 1
            dst_count[d] += 1
    assert in_flight_dev == pool.device.in_flight, "device in-flight holds differ from swaps"
    assert in_flight_host == pool.host.in_flight, "host in-flight holds differ from swaps"


def _check_hashes(pool: BlockPool, table: BlockTable) -> None:
    bs = pool.block_size
    if not pool.enable_prefix_caching:
        assert not table.block_hashes
        assert not table.partial_token_ids
        return
    partial = table.partial_token_ids
    # a block filled by a late token stays partial (unhashed) until the token's value is set
    deferred = len(partial) == bs and partial[-1] == LATE_TOKEN
    assert LATE_TOKEN not in partial[:-1], f"{table.seq_id!r}: a late token before the last"
    full = table.num_tokens // bs - deferred
    assert len(table.block_hashes) == full, f"{table.seq_id!r}: hash count"
    assert len(partial) == (bs if deferred else table.num_tokens % bs)
    if table.location is Location.DEVICE:
        for block, block_hash in zip(table.block_ids, table.block_hashes, strict=False):
            registered = pool.device.hash_of(block)
            assert registered is None or registered == block_hash, (
                "block registered under a wrong hash"
            )
    assert ROOT_HASH not in table.block_hashes
