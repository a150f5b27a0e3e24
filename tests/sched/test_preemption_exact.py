"""The allocator preempts exactly as far as the appends need (kv/txn.py).

The pool below: A (oldest) needs 5 new blocks with 2 free; B holds one block; the two newest, C
and D, hold one block each plus a full prefix block they share. Preempting D frees 1 block, then
C frees 2 (its own and the shared one, now its alone), so D and C make room and B keeps running.
Counting each victim's blocks as they stood before the transaction (C's and D's exclusive
blocks: 1 each) would have preempted B as well.
"""

from __future__ import annotations

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.txn import StepTxn, apply_txn

BS = 16
A, B, C, D = 0, 1, 2, 3


def _pool(num_host_blocks: int = 0) -> BlockPool:
    pool = BlockPool(7, num_host_blocks, block_size=BS)
    assert pool.allocate(A, [1] * BS) is not None  # one full block: its next token takes one
    assert pool.allocate(B, [2] * 3) is not None
    prefix = list(range(100, 100 + BS))
    assert pool.allocate(C, [*prefix, 7]) is not None
    assert pool.allocate(D, [*prefix, 8]) is not None
    assert pool.block_ids(C)[0] == pool.block_ids(D)[0]  # the shared prefix block
    assert pool.num_free_device_blocks == 2
    return pool


def _txn(swap: bool) -> StepTxn:
    grow = (5,) * (4 * BS + 1)  # 5 new blocks for A
    return StepTxn(
        append_seq_ids=(A, B, C, D),
        append_token_ids=(grow, (9,), (9,), (9,)),
        append_group_sizes=(1, 1, 1, 1),
        victims=((D,), (C,), (B,), (A,)),
        swap_victims=swap,
    )


def test_recompute_preempts_only_what_the_appends_need() -> None:
    pool = _pool()
    result = apply_txn(pool, _txn(swap=False))
    assert result.preempted == (False, False)  # D, then C: freed; B untouched
    assert len(result.append_slots) == 2  # A's and B's appends ran
    assert not pool.has_seq(C) and not pool.has_seq(D)
    assert pool.num_tokens(A) == 5 * BS + 1 and pool.num_tokens(B) == 4
    assert pool.num_free_device_blocks == 0
    assert result.swap_ins == () and result.admitted == ()
    pool.check_invariants()


def test_swap_waits_for_the_blocks_its_swap_outs_release() -> None:
    """Swapped-out blocks are free only when the copies complete: once the swap-outs of D and C
    will release enough (the shared block counted once), A waits instead of preempting B."""
    pool = _pool(num_host_blocks=8)
    result = apply_txn(pool, _txn(swap=True))
    assert result.preempted == (True, True)
    assert [p.seq_ids for p in result.swap_outs] == [(D,), (C,)]
    assert result.append_slots == ()  # A waits for the copies, and B (newer) with it
    assert pool.num_blocks_coming == 3
    for plan in result.swap_outs:
        pool.complete_swap(plan.swap_id)
    assert pool.num_free_device_blocks == 5
    pool.check_invariants()


def test_no_pressure_runs_every_append() -> None:
    pool = _pool()
    txn = StepTxn(append_seq_ids=(B, C, D), append_token_ids=((9,), (9,), (9,)))
    result = apply_txn(pool, txn)
    assert result.preempted == () and len(result.append_slots) == 3
    pool.check_invariants()
