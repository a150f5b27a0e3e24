"""Placeholders (async scheduling): a sequence's next token appended as ``PLACEHOLDER_TOKEN``
and given its value by the next transaction leaves the pool exactly as appending the value at
once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpaged.errors import BlockPoolError
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
from asyncpaged.kv.txn import StepTxn, apply_txn

BS = 4


def _pool(caching: bool = True) -> BlockPool:
    return BlockPool(64, 8, block_size=BS, enable_prefix_caching=caching)


# A script: per step, which sequences append one token, and whether it goes in late.
steps = st.lists(
    st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=3),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(script=steps, prompt_lens=st.tuples(*[st.integers(1, 9)] * 3), caching=st.booleans())
def test_a_late_token_set_later_equals_the_token_appended_at_once(
    script: list[list[tuple[int, bool]]], prompt_lens: tuple[int, int, int], caching: bool
) -> None:
    direct, late = _pool(caching), _pool(caching)
    counters = {}
    for seq in range(3):  # distinct tokens per sequence: no two blocks share a hash
        prompt = [1000 * seq + i for i in range(prompt_lens[seq])]
        counters[seq] = len(prompt)
        for pool in (direct, late):
            assert pool.allocate(seq, prompt) is not None
    pending: dict[int, int] = {}  # seq -> the value its placeholder gets next step
    for step in script:
        # the next transaction first gives last step's placeholders their values
        txn = StepTxn(placeholder_values=tuple(pending.items()))
        apply_txn(late, txn)
        pending = {}
        for seq, is_placeholder in dict(step).items():
            token = 1000 * seq + counters[seq]
            counters[seq] += 1
            assert direct.append(seq, [token]) is not None
            result = late.append(seq, [PLACEHOLDER_TOKEN if is_placeholder else token])
            assert result is not None
            if is_placeholder:
                pending[seq] = token
            late.check_invariants()
    apply_txn(late, StepTxn(placeholder_values=tuple(pending.items())))
    late.check_invariants()
    assert late.state() == direct.state()
    for seq in range(3):  # and every block frees (and caches) alike
        direct.free(seq)
        late.free(seq)
    assert late.state() == direct.state()


def test_a_late_token_that_fills_a_block_registers_it_once_set() -> None:
    pool = _pool()
    pool.allocate("a", [1, 2, 3])
    pool.append("a", [PLACEHOLDER_TOKEN])  # fills block 0
    assert pool.lookup_prefix([1, 2, 3, 4, 5]).num_tokens == 0
    pool.set_placeholder("a", 4)
    assert pool.lookup_prefix([1, 2, 3, 4, 5]).num_tokens == BS
    pool.check_invariants()


def test_a_sequence_with_a_late_token_only_frees_or_takes_its_value() -> None:
    pool = _pool()
    pool.allocate("a", [1, 2])
    pool.append("a", [PLACEHOLDER_TOKEN])
    for action in (
        lambda: pool.append("a", [5]),
        lambda: pool.append_token("a", 5),
        lambda: pool.fork("a", "b"),
        lambda: pool.truncate("a", 2),
        lambda: pool.swap_out(["a"]),
    ):
        with pytest.raises(BlockPoolError, match="late"):
            action()
    with pytest.raises(BlockPoolError, match="alone"):
        pool.append("a", [PLACEHOLDER_TOKEN, 3])
    with pytest.raises(BlockPoolError, match=">= 0"):
        pool.set_placeholder("a", PLACEHOLDER_TOKEN)
    pool.set_placeholder("a", 3)
    with pytest.raises(BlockPoolError, match="no placeholder"):
        pool.set_placeholder("a", 3)
    pool.append("a", [PLACEHOLDER_TOKEN])
    pool.free("a")  # freed before its value came: nothing of it is cached
    pool.check_invariants()
    assert pool.lookup_prefix([1, 2, 3, 9, 9]).num_tokens == 0
