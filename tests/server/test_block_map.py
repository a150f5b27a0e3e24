"""``build_block_map`` on a hand-driven pool: exact states, holders and counts, never a change."""

from __future__ import annotations

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.sched.block_map import BlockMap, BlockState, build_block_map
from asyncpaged.sched.request import Request, StopCriteria
from asyncpaged.sched.request import Sequence as Seq

U, C, S, F = BlockState.USED, BlockState.CACHED, BlockState.SWAPPING, BlockState.FREE


def _request(rid: str, seq_ids: list[int]) -> Request:
    seqs = [Seq(seq_id=s, index=i, token_ids=[1], num_prompt_tokens=1)
            for i, s in enumerate(seq_ids)]  # fmt: skip
    return Request(request_id=rid, arrival=0, seqs=seqs, stop=StopCriteria(max_tokens=4))


def _snap(pool: BlockPool, requests: list[Request]) -> BlockMap:
    before = pool.state()
    snapshot = build_block_map(pool, requests)
    assert pool.state() == before, "the snapshot changed the pool"
    return snapshot


def test_states_holders_and_counts_follow_the_pool() -> None:
    pool = BlockPool(8, 4, block_size=4, enable_prefix_caching=True)
    a, b = _request("a", [1, 2]), _request("b", [3])
    assert pool.allocate(1, [10, 11, 12, 13, 14, 15]) is not None  # blocks 0 (full), 1
    pool.fork(1, 2)
    assert pool.allocate(3, [10, 11, 12, 13, 20, 21, 22, 23, 24]) is not None  # hit 0; 2, 3
    pin = pool.pin_prefix([10, 11, 12, 13])
    assert pin is not None

    m = _snap(pool, [a, b])
    assert m.device.states == (U, U, U, U, F, F, F, F)
    assert m.device.ref_cnt == (4, 2, 1, 1, 0, 0, 0, 0)
    assert m.device.num_filled == (4, 2, 4, 1, 0, 0, 0, 0)
    assert m.device.holders == {0: ("a", "b", f"pin:{pin.pin_id}"), 1: ("a",), 2: ("b",),
                                3: ("b",)}  # fmt: skip
    assert m.device.block(0).is_shared and not m.device.block(2).is_shared
    assert [(r.request_id, r.num_seqs, r.num_device_blocks, r.num_host_blocks)
            for r in m.requests] == [("a", 2, 2, 0), ("b", 1, 3, 0)]  # fmt: skip
    assert m.host.states == (F, F, F, F)
    assert m.pins == {pin.pin_id: (0,)}

    plan = pool.swap_out([3])
    assert plan is not None
    m = _snap(pool, [a, b])
    assert m.device.states[:4] == (S, U, S, S)
    assert m.device.ref_cnt[:4] == (4, 2, 1, 1)  # the copy holds 0, 2 and 3
    assert m.device.in_flight == {0: 1, 2: 1, 3: 1}
    assert m.device.holders == {0: ("a", f"pin:{pin.pin_id}"), 1: ("a",)}
    assert m.host.states == (S, S, S, F)
    assert m.host.holders == {0: ("b",), 1: ("b",), 2: ("b",)}
    assert m.requests[1].num_device_blocks == 0 and m.requests[1].num_host_blocks == 3

    pool.complete_swap(plan.swap_id)
    m = _snap(pool, [b])  # "a" finished: its tables wait for their free
    assert m.device.states[:4] == (U, U, C, F)  # 2 is full and hashed: cached; 3 is partial
    assert m.device.holders[0] == ("seq:1", "seq:2", f"pin:{pin.pin_id}")
    assert m.host.states == (U, U, U, F) and m.host.ref_cnt == (1, 1, 1, 0)
    assert m.device.count(C) == 1 and m.device.count(F) == 5

    pool.free(1)
    pool.free(2)
    pool.unpin_prefix(pin.pin_id)
    pool.free(3)
    m = _snap(pool, [])
    assert m.device.states == (C, F, C, F, F, F, F, F)
    assert m.device.num_filled == (4, 0, 4, 0, 0, 0, 0, 0)
    assert m.host.states == (F,) * 4
    assert m.device.holders == {} and m.requests == () and m.pins == {}
