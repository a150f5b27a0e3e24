"""A tour of the block pool: allocate, fork, copy-on-write, prefix hits, swap."""

from asyncpaged.kv.block_pool import BlockPool


def main() -> None:
    pool = BlockPool(num_device_blocks=8, num_host_blocks=8, block_size=4)
    prompt = [11, 12, 13, 14, 15, 16]
    a = pool.allocate("a", prompt)
    assert a is not None
    print("a:", a.block_ids, "slots", a.slot_mapping)

    pool.fork("a", "b")  # parallel sampling: share the prompt's blocks
    r = pool.append("b", [99])  # b writes into the shared partial block: copy-on-write
    assert r is not None
    print("b appends: copy", r.copy_on_write, "slot", r.slot_mapping, "table", pool.block_ids("b"))

    c = pool.allocate("c", [*prompt[:4], 42])  # same first block: a prefix-cache hit
    assert c is not None
    print("c: cached tokens", c.num_cached_tokens, "table", c.block_ids)

    plan = pool.swap_out(["a", "b"])  # preempt the group by swapping it to host memory
    assert plan is not None
    print("swap out", plan.block_mapping, "->", pool.statistics().device)
    pool.complete_swap(plan.swap_id)  # the executor confirms the copies
    for seq in ("a", "b", "c"):
        pool.free(seq)
    print("after free:", pool.statistics().device)


if __name__ == "__main__":
    main()
