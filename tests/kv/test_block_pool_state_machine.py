"""The real block pool driven beside a trivially correct model of it.

The model simulates the KV cache itself: every slot the pool hands out is "written" with what a
real K/V row depends on (the extra key and every token up to that position); copy-on-write pairs
and swap copies move those contents, swap copies only when the swap completes (the latest moment an
executor may copy). After every rule, reading each settled sequence through its block table must
give back exactly its tokens. That one check catches wrong slots, a missed or misdirected
copy-on-write, a prefix hit on the wrong content, a swap mapping error, and an in-flight or shared
block handed out and overwritten.

Speculative decoding: an append may mark its last tokens speculative, and ``truncate`` keeps a
prefix of them (or drops further back). The model records which slot contents were ever verified
(written normally, or speculative and kept by a truncation); every slot of every block in the
prefix cache must hold verified content, so a rejected token never enters the cache.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import event
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from asyncpaged.errors import BlockPoolError
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import AppendResult, Location, SwapDirection, SwapPlan

BS = 4
BASES = [
    [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0],
    [1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0, 3, 3, 3, 3],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
]
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=7)
prompts_st = st.builds(
    lambda base, n, tail: base[:n] + tail,
    st.sampled_from(BASES),
    st.integers(1, 16),
    st.lists(st.integers(0, 3), min_size=0, max_size=5),
)
extra_st = st.sampled_from([None, None, "tenant-a"])

Slot = tuple[str | None, tuple[int, ...]]  # (extra key, every token up to this position)


@dataclass
class ModelSeq:
    tokens: list[int]
    extra_key: str | None
    location: Location = Location.DEVICE
    spec_start: int | None = None  # first unverified position (an open speculative tail)


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool
        self.model: dict[int, ModelSeq] = {}
        self.kv: dict[tuple[str, int], list[Slot | None]] = {}
        self.pins: dict[int, tuple[int, ...]] = {}
        self.swaps: dict[int, SwapPlan] = {}
        self.ids = itertools.count()
        self.verified: set[Slot] = set()  # slot contents some sequence wrote and kept
        self.seen: set[str] = set()
        self.num_steps = 0

    def note(self, what: str) -> None:
        self.seen.add(what)

    @initialize(
        num_device=st.integers(4, 24),
        num_host=st.integers(0, 12),
        caching=st.sampled_from([True, True, True, False]),
    )
    def init_pool(self, num_device: int, num_host: int, caching: bool) -> None:
        self.pool = BlockPool(num_device, num_host, block_size=BS, enable_prefix_caching=caching)

    # ---- the model's view ------------------------------------------------------------------

    def holders(self, pool: str) -> dict[int, int]:
        """Holder count of each block, from the model's tables, pins and swaps in flight."""
        refs: dict[int, int] = {}
        for sid, seq in self.model.items():
            if (pool == "host") == seq.location.on_host:
                for b in self.pool.block_ids(sid):
                    refs[b] = refs.get(b, 0) + 1
        if pool == "device":
            for blocks in self.pins.values():
                for b in blocks:
                    refs[b] = refs.get(b, 0) + 1
        for plan in self.swaps.values():
            out = plan.direction is SwapDirection.OUT
            for s, d in plan.block_mapping:
                for b, side in ((s, "device" if out else "host"), (d, "host" if out else "device")):
                    if side == pool:
                        refs[b] = refs.get(b, 0) + 1
        return refs

    def available(self, pool: str) -> int:
        total = self.pool.device.num_blocks if pool == "device" else self.pool.host.num_blocks
        return total - len(self.holders(pool))

    def content(self, seq: ModelSeq, upto: int) -> list[Slot]:
        return [(seq.extra_key, tuple(seq.tokens[: p + 1])) for p in range(upto)]

    def read(self, pool: str, block_ids: tuple[int, ...], num_tokens: int) -> list[Slot | None]:
        return [self.kv[(pool, block_ids[p // BS])][p % BS] for p in range(num_tokens)]

    def write(self, seq: ModelSeq, first_pos: int, slots: tuple[int, ...]) -> None:
        for i, slot in enumerate(slots):
            pos = first_pos + i
            row = self.kv.setdefault(("device", slot // BS), [None] * BS)
            row[slot % BS] = content = (seq.extra_key, tuple(seq.tokens[: pos + 1]))
            if seq.spec_start is None or pos < seq.spec_start:
                self.verified.add(content)

    def expect_unchanged_on_none(self, before: object, result: object) -> None:
        if result is None:
            assert self.pool.state() == before, "a failed allocation changed the pool"

    # ---- rules -----------------------------------------------------------------------------

    def live(self, data: st.DataObject, where: Location | None = None) -> int:
        return data.draw(st.sampled_from(sorted(
            s for s, m in self.model.items() if where is None or m.location is where
        )))  # fmt: skip

    def has(self, where: Location | None = None) -> bool:
        return any(where is None or m.location is where for m in self.model.values())

    @rule(prompt=prompts_st, extra=extra_st, chunk=st.none() | st.integers(1, 12))
    def allocate(self, prompt: list[int], extra: str | None, chunk: int | None) -> None:
        sid = next(self.ids)
        hit = self.pool.lookup_prefix(prompt, extra)
        assert hit.num_tokens == len(hit.block_ids) * BS < len(prompt)
        probe = ModelSeq(prompt, extra)
        assert self.read("device", hit.block_ids, hit.num_tokens) == self.content(
            probe, hit.num_tokens
        )
        num_tokens = len(prompt) if chunk is None else min(len(prompt), hit.num_tokens + chunk)
        held = self.holders("device")
        need = -(-num_tokens // BS) - len(hit.block_ids) + sum(b not in held for b in hit.block_ids)
        available = self.available("device")
        before = self.pool.state()
        result = self.pool.allocate(sid, prompt, max_new_tokens=chunk, extra_key=extra)
        self.expect_unchanged_on_none(before, result)
        assert (result is None) == (need > available)
        self.note("allocate failed" if result is None else "allocated")
        if result is None:
            return
        if result.num_cached_tokens:
            self.note("prefix hit")
        assert result.num_cached_tokens == hit.num_tokens
        assert result.block_ids[: len(hit.block_ids)] == hit.block_ids
        assert not set(result.block_ids[len(hit.block_ids) :]) & set(held), "took a held block"
        assert len(result.slot_mapping) == num_tokens - hit.num_tokens
        seq = self.model[sid] = ModelSeq(prompt[:num_tokens], extra)
        self.write(seq, hit.num_tokens, result.slot_mapping)

    @precondition(lambda self: self.has(Location.DEVICE))
    @rule(data=st.data(), tokens=tokens_st)
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        sid = self.live(data, Location.DEVICE)
        seq = self.model[sid]
        table = self.pool.block_ids(sid)
        n = len(seq.tokens)
        num_spec = data.draw(st.sampled_from([0, 0, len(tokens) - 1, len(tokens)]), label="spec")
        if seq.spec_start is not None:  # an open speculative tail: truncate first
            before = self.pool.state()
            assert self.pool.append_token(sid, tokens[0]) is None
            with pytest.raises(BlockPoolError, match="not yet verified"):
                self.pool.append(sid, tokens, num_speculative_tokens=num_spec)
            assert self.pool.state() == before
            self.note("append refused before truncate")
            return
        held = self.holders("device")
        cow = n % BS != 0 and held[table[-1]] > 1
        need = -(-(n + len(tokens)) // BS) - len(table) + cow
        available = self.available("device")
        before = self.pool.state()
        result: AppendResult | None = None
        if len(tokens) == 1 and not num_spec and data.draw(st.booleans(), label="fast path"):
            # append_token takes exactly the in-place case: room in an exclusive last block
            slot = self.pool.append_token(sid, tokens[0])
            assert (slot is not None) == (n % BS != 0 and not cow)
            if slot is None:
                assert self.pool.state() == before
            else:
                self.note("append_token")
                result = AppendResult(slot_mapping=(slot,), copy_on_write=())
        if result is None:
            result = self.pool.append(sid, tokens, num_speculative_tokens=num_spec)
            self.expect_unchanged_on_none(before, result)
        assert (result is None) == (need > available)
        if result is None:
            return
        new_table = self.pool.block_ids(sid)
        assert new_table[: len(table) - 1] == table[:-1], "append moved a full block"
        self.note("appended")
        if cow:
            self.note("copy-on-write")
            ((src, dst),) = result.copy_on_write
            assert src == table[-1]
            assert dst == new_table[len(table) - 1]
            assert dst not in held
            self.kv[("device", dst)] = list(self.kv[("device", src)])
        else:
            assert result.copy_on_write == ()
            assert new_table[: len(table)] == table
        assert not set(new_table[len(table) :]) & set(held), "took a held block"
        seq.tokens.extend(tokens)
        if num_spec:
            seq.spec_start = len(seq.tokens) - num_spec
            self.note("speculative append")
        self.write(seq, n, result.slot_mapping)

    @precondition(lambda self: self.has(Location.DEVICE))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Roll back rejected proposals (or any tail whose last block's tokens are known)."""
        sid = self.live(data, Location.DEVICE)
        seq = self.model[sid]
        n_old = len(seq.tokens)
        if seq.spec_start is not None:
            known_start = seq.spec_start - seq.spec_start % BS
        else:
            known_start = n_old - n_old % BS
        # mostly a verification (keep a prefix of the proposals), sometimes any recent length
        verifying = seq.spec_start is not None and data.draw(st.booleans(), label="verify")
        lo = max(1, seq.spec_start if verifying else n_old - 2 * BS)
        n = data.draw(st.integers(lo, n_old), label="num_tokens")
        known = not self.pool.enable_prefix_caching or n % BS == 0 or n - n % BS >= known_start
        before = self.pool.state()
        if not known:
            with pytest.raises(BlockPoolError, match="no longer known"):
                self.pool.truncate(sid, n)
            assert self.pool.state() == before
            self.note("truncate refused")
            return
        table = self.pool.block_ids(sid)
        held = self.holders("device")
        free_before = self.pool.num_free_device_blocks
        dropped = self.pool.truncate(sid, n)
        keep = -(-n // BS)
        assert dropped == table[keep:]
        assert self.pool.block_ids(sid) == table[:keep], "truncate moved a kept block"
        assert self.pool.num_tokens(sid) == n
        released = sum(1 for b in dropped if held[b] == 1)
        assert self.pool.num_free_device_blocks == free_before + released
        assert not self.pool.has_speculative_tokens(sid)
        if seq.spec_start is not None:
            self.note("speculative tail verified")
            for pos in range(seq.spec_start, n):
                self.verified.add((seq.extra_key, tuple(seq.tokens[: pos + 1])))
            if n < n_old:
                self.note("proposals rejected")
        if n % BS and held[table[keep - 1]] > 1:
            self.note("truncated into a shared block")
        seq.spec_start = None
        del seq.tokens[n:]

    @precondition(lambda self: self.has())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.live(data)
        child = next(self.ids)
        seq = self.model[parent]
        if seq.location is not Location.DEVICE or seq.spec_start is not None:
            before = self.pool.state()
            with pytest.raises(BlockPoolError):
                self.pool.fork(parent, child)
            assert self.pool.state() == before
            return
        free_before = self.pool.num_free_device_blocks
        self.pool.fork(parent, child)
        assert self.pool.num_free_device_blocks == free_before, "fork allocated"
        assert self.pool.block_ids(child) == self.pool.block_ids(parent)
        self.model[child] = ModelSeq(list(seq.tokens), seq.extra_key)

    @precondition(lambda self: self.has(Location.DEVICE))
    @rule(data=st.data(), width=st.integers(1, 3), drop_parent=st.booleans())
    def beam_churn(self, data: st.DataObject, width: int, drop_parent: bool) -> None:
        """A beam step: the parent forks into ``width`` candidates and is dropped or kept."""
        parent = self.live(data, Location.DEVICE)
        seq = self.model[parent]
        if seq.spec_start is not None:
            return  # forks of an unverified tail are refused (the fork rule checks that)
        free_before = self.pool.num_free_device_blocks
        for _ in range(width):
            child = next(self.ids)
            self.pool.fork(parent, child)
            self.model[child] = ModelSeq(list(seq.tokens), seq.extra_key)
        if drop_parent:
            self.pool.free(parent)
            del self.model[parent]
        assert self.pool.num_free_device_blocks >= free_before  # forks never allocate
        self.note("beam churn")

    @precondition(lambda self: self.has())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = self.live(data)
        self.pool.free(sid)
        del self.model[sid]

    @precondition(lambda self: self.has())
    @rule(data=st.data(), num_blocks=st.integers(1, 6))
    def pin(self, data: st.DataObject, num_blocks: int) -> None:
        seq = self.model[self.live(data)]
        if not self.pool.enable_prefix_caching or len(seq.tokens) < BS:
            return
        num_blocks = min(num_blocks, len(seq.tokens) // BS)
        tokens = seq.tokens[: num_blocks * BS]
        before = self.pool.state()
        pinned = self.pool.pin_prefix(tokens, seq.extra_key)
        if pinned is None:
            assert self.pool.state() == before
            return
        self.note("pinned")
        assert pinned.num_tokens == len(tokens)
        assert self.read("device", pinned.block_ids, len(tokens)) == self.content(seq, len(tokens))
        self.pins[pinned.pin_id] = pinned.block_ids

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pin_id = data.draw(st.sampled_from(sorted(self.pins)))
        self.pool.unpin_prefix(pin_id)
        del self.pins[pin_id]

    @precondition(lambda self: self.has(Location.DEVICE))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        self.swap(data, SwapDirection.OUT)

    @precondition(lambda self: self.has(Location.HOST))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self.swap(data, SwapDirection.IN)

    def swap(self, data: st.DataObject, direction: SwapDirection) -> None:
        out = direction is SwapDirection.OUT
        want = Location.DEVICE if out else Location.HOST
        candidates = sorted(s for s, m in self.model.items() if m.location is want)
        group = data.draw(
            st.lists(st.sampled_from(candidates), min_size=1, max_size=4, unique=True)
        )
        src_pool, dst_pool = ("device", "host") if out else ("host", "device")
        if out and any(self.model[sid].spec_start is not None for sid in group):
            before = self.pool.state()
            with pytest.raises(BlockPoolError, match="not yet verified"):
                self.pool.swap_out(group)
            assert self.pool.state() == before
            self.note("swap out refused before truncate")
            return
        tables = {sid: self.pool.block_ids(sid) for sid in group}
        distinct = list(dict.fromkeys(b for sid in group for b in tables[sid]))
        dst_held = self.holders(dst_pool)
        available = self.available(dst_pool)
        before = self.pool.state()
        plan = self.pool.swap_out(group) if out else self.pool.swap_in(group)
        self.expect_unchanged_on_none(before, plan)
        assert (plan is None) == (len(distinct) > available)
        self.note(f"swap {direction.value} failed" if plan is None else f"swap {direction.value}")
        if plan is None:
            return
        assert [s for s, _ in plan.block_mapping] == distinct
        dsts = [d for _, d in plan.block_mapping]
        assert len(set(dsts)) == len(dsts)
        assert not set(dsts) & set(dst_held)
        mapping = dict(plan.block_mapping)
        for sid in group:
            assert self.pool.block_ids(sid) == tuple(mapping[b] for b in tables[sid])
            self.model[sid].location = Location.SWAPPING_OUT if out else Location.SWAPPING_IN
        for d in dsts:  # nothing is copied yet: poison the destinations
            self.kv[(dst_pool, d)] = [None] * BS
        del src_pool
        self.swaps[plan.swap_id] = plan

    @precondition(lambda self: self.swaps)
    @rule(data=st.data())
    def complete_swap(self, data: st.DataObject) -> None:
        swap_id = data.draw(st.sampled_from(sorted(self.swaps)))
        plan = self.swaps.pop(swap_id)
        out = plan.direction is SwapDirection.OUT
        src_pool, dst_pool = ("device", "host") if out else ("host", "device")
        for s, d in plan.block_mapping:
            self.kv[(dst_pool, d)] = list(self.kv[(src_pool, s)])
        self.pool.complete_swap(swap_id)
        self.note("swap completed")
        for sid in plan.seq_ids:
            if sid in self.model:
                self.model[sid].location = Location.HOST if out else Location.DEVICE

    @precondition(lambda self: self.has(Location.DEVICE))
    @rule(data=st.data())
    def group_append_need(self, data: st.DataObject) -> None:
        """``num_blocks_to_append_all`` is what running those appends in order consumes
        (siblings sharing a partial tail: only the last writes in place), on a copy."""
        verified = sorted(s for s, m in self.model.items()
                          if m.location is Location.DEVICE and m.spec_start is None)  # fmt: skip
        if not verified:
            return
        sids = data.draw(st.lists(st.sampled_from(verified), min_size=1, max_size=3, unique=True))
        counts = [data.draw(st.integers(1, 3 * BS), label="tokens") for _ in sids]
        need = self.pool.num_blocks_to_append_all(list(zip(sids, counts, strict=True)))
        trial = copy.deepcopy(self.pool)
        free = trial.num_free_device_blocks
        if need > free:
            return
        for sid, n in zip(sids, counts, strict=True):  # the class's own method: a subclass
            # machine may wrap the instance's (tests/kv/test_kv_tiers.py replays tier ops)
            assert BlockPool.append(trial, sid, [1] * n) is not None
        assert free - trial.num_free_device_blocks == need
        self.note("group append need")

    @precondition(lambda self: self.swaps)
    @rule()
    def blocks_coming(self) -> None:
        """``num_blocks_coming`` is what completing every swap-out frees, on a copy."""
        trial = copy.deepcopy(self.pool)
        free = trial.num_free_device_blocks
        for swap_id, plan in self.swaps.items():
            if plan.direction is SwapDirection.OUT:
                BlockPool.complete_swap(trial, swap_id)
        assert trial.num_free_device_blocks - free == self.pool.num_blocks_coming
        self.note("blocks coming")

    @rule(num_blocks=st.none() | st.integers(0, 4))
    def evict(self, num_blocks: int | None) -> None:
        cached = self.pool.statistics().device.cached
        evicted = self.pool.evict_cached_blocks(num_blocks)
        assert evicted == (cached if num_blocks is None else min(cached, num_blocks))

    @precondition(lambda self: self.has())
    @rule(data=st.data(), tokens=tokens_st)
    def bad_calls(self, data: st.DataObject, tokens: list[int]) -> None:
        sid = self.live(data)
        before = self.pool.state()
        with pytest.raises(BlockPoolError, match="unknown sequence"):
            self.pool.free(10**9)
        with pytest.raises(BlockPoolError, match="unknown sequence"):
            self.pool.append(10**9, tokens)
        with pytest.raises(BlockPoolError, match="already exists"):
            self.pool.allocate(sid, tokens)
        with pytest.raises(BlockPoolError):
            self.pool.fork(sid, sid)
        with pytest.raises(BlockPoolError, match="empty"):
            self.pool.allocate(10**9, [])
        if self.model[sid].location is not Location.DEVICE:
            with pytest.raises(BlockPoolError, match="not on device"):
                self.pool.append(sid, tokens)
            with pytest.raises(BlockPoolError):
                self.pool.swap_out([sid])
        with pytest.raises(BlockPoolError):
            self.pool.swap_out([sid, sid])
        with pytest.raises(BlockPoolError, match="no swap in flight"):
            self.pool.complete_swap(10**9)
        with pytest.raises(BlockPoolError, match="no pinned prefix"):
            self.pool.unpin_prefix(10**9)
        with pytest.raises(BlockPoolError, match="unknown sequence"):
            self.pool.truncate(10**9, 1)
        if self.model[sid].location is Location.DEVICE:
            with pytest.raises(BlockPoolError, match="keep at least 1"):
                self.pool.truncate(sid, 0)
            with pytest.raises(BlockPoolError, match="keep at least 1"):
                self.pool.truncate(sid, len(self.model[sid].tokens) + 1)
            with pytest.raises(BlockPoolError, match="num_speculative_tokens"):
                self.pool.append(sid, tokens, num_speculative_tokens=len(tokens) + 1)
        else:
            with pytest.raises(BlockPoolError, match="not on device"):
                self.pool.truncate(sid, 1)
        assert self.pool.state() == before
        self.note("bad calls")

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def pool_invariants(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.num_steps += 1
        self.pool.check_invariants()
        for name, phys in (("device", self.pool.device), ("host", self.pool.host)):
            holders = self.holders(name)
            assert {b: phys.ref_cnt[b] for b in holders} == holders
            assert sum(phys.ref_cnt) == sum(holders.values())
        stats = self.pool.statistics()
        for usage in (stats.device, stats.host):
            assert usage.free + usage.used + usage.cached + usage.in_flight == usage.total
        in_flight = {s if p.direction is SwapDirection.OUT else d for p in self.swaps.values()
                     for s, d in p.block_mapping}  # fmt: skip
        assert stats.device.in_flight == len(in_flight)
        assert stats.num_filled_device_slots <= stats.num_held_device_blocks * BS
        # a block's written slots cover every holder's tokens in it (a truncation into a block
        # a fork shares leaves the fork's slots counted)
        for sid, seq in self.model.items():
            phys = self.pool.host if seq.location.on_host else self.pool.device
            for i, b in enumerate(self.pool.block_ids(sid)):
                assert phys.num_filled[b] >= min(BS, len(seq.tokens) - i * BS), (
                    f"block {b} counts fewer slots than seq {sid} holds"
                )

    @invariant()
    def cache_holds_only_verified_tokens(self) -> None:
        if not hasattr(self, "pool"):
            return
        device = self.pool.device
        for block in range(device.num_blocks):
            if device.hash_of(block) is not None:
                row = self.kv[("device", block)]
                assert all(slot in self.verified for slot in row), (
                    f"block {block} is in the prefix cache with unverified (rejected) tokens"
                )

    @invariant()
    def contents(self) -> None:
        for sid, seq in self.model.items():
            if seq.location in (Location.DEVICE, Location.HOST):
                pool = "host" if seq.location is Location.HOST else "device"
                got = self.read(pool, self.pool.block_ids(sid), len(seq.tokens))
                assert got == self.content(seq, len(seq.tokens)), f"seq {sid} reads wrong KV"

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        event(f"steps >= {self.num_steps // 10 * 10}")
        for what in sorted(self.seen):
            event(what)
        for swap_id in sorted(self.swaps):
            self.pool.complete_swap(swap_id)
        for sid in list(self.model):
            self.pool.free(sid)
        for pin_id in list(self.pins):
            self.pool.unpin_prefix(pin_id)
        self.pool.check_invariants()
        stats = self.pool.statistics()
        assert stats.device.used == stats.device.in_flight == 0
        assert stats.host.free == stats.host.total
        self.pool.evict_cached_blocks()
        assert self.pool.statistics().device.free == stats.device.total
        self.pool.check_invariants()


TestBlockPoolStateMachine = BlockPoolMachine.TestCase
