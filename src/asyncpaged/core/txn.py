"""The step transaction between the scheduler and the allocator, and the allocator's side of it.

The scheduler owns the queues and decides; the allocator owns the :class:`BlockPool` and applies
one :class:`StepTxn` per step atomically, in this order::

    complete_swaps -> forks -> pins -> unpins -> frees -> truncates -> swap_outs -> appends
    -> swap_ins -> admissions

Everything up to ``swap_ins`` is *mandatory*: the scheduler planned it against the exact
:class:`PoolSnapshot` the allocator returned after the previous transaction, and nothing else
consumes blocks in between, so it cannot fail (asserted). *Admissions* are conditional: they are
tried first come, first served, each with the exact prefix-cache lookup, and the first one that
does not fit (keeping ``watermark_blocks`` free) stops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncpaged.core.block_pool import BlockPool
from asyncpaged.core.block_table import PinnedPrefix, PoolStatistics, SeqId, SwapPlan
from asyncpaged.core.kv_tiers import TierOp

NUM_REPORTED_GROUPS = 8
"""Newest running groups whose release counts each snapshot carries (preemption candidates)."""

# ---- messages -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocateOp:
    seq_id: int
    token_ids: tuple[int, ...]
    max_new_tokens: int
    extra_key: str | None
    read_cache: bool = True  # False: map no cached block (the request needs every position)


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """A request's sequences, admitted together or not at all."""

    request_id: str
    ops: tuple[AllocateOp, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PinOp:
    pin_id: int
    token_ids: tuple[int, ...]
    extra_key: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTxn:
    complete_swaps: tuple[int, ...] = ()
    forks: tuple[tuple[int, int], ...] = ()  # (parent, child): never allocates
    pins: tuple[PinOp, ...] = ()  # prefixes whose request computed them (before its frees)
    unpins: tuple[int, ...] = ()
    frees: tuple[int, ...] = ()
    swap_outs: tuple[tuple[int, ...], ...] = ()
    # Appends to running sequences, column-wise (one entry per sequence, no per-sequence
    # objects: a step appends to every running sequence): its id and the tokens it appends.
    append_seq_ids: tuple[int, ...] = ()
    append_token_ids: tuple[tuple[int, ...], ...] = ()
    # Per append entry (empty: none anywhere): how many of its last tokens are proposals to
    # verify (speculative decoding; ``BlockPool.append(num_speculative_tokens=...)``).
    append_num_draft: tuple[int, ...] = ()
    # (seq id, tokens kept) after a verification: the rejected proposals' slots roll back
    # (``BlockPool.truncate``), after the frees and before the swap-outs and appends.
    truncates: tuple[tuple[int, int], ...] = ()
    swap_ins: tuple[tuple[int, ...], ...] = ()
    admissions: tuple[Admission, ...] = ()
    watermark_blocks: int = 0
    # Running groups, oldest first, whose release counts to report (with the admitted ones,
    # the newest NUM_REPORTED_GROUPS of them are reported: the next preemption victims).
    report_groups: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotGrant:
    """Slots for one sequence's new tokens, and its block table afterwards."""

    seq_id: int
    num_cached_tokens: int
    slot_mapping: tuple[int, ...]
    block_table: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupReport:
    """For a device-resident group: blocks only it holds (freed if it is freed or swapped out)
    and distinct blocks (host blocks a swap-out takes)."""

    seq_ids: tuple[int, ...]
    num_exclusive_blocks: int
    num_distinct_blocks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSnapshot:
    """The pool's state after a transaction: exact, since only transactions change it."""

    num_free_device_blocks: int
    num_free_host_blocks: int
    shared_tails: frozenset[SeqId]  # device sequences whose partial last block is shared
    groups: tuple[GroupReport, ...]
    statistics: PoolStatistics


@dataclass(frozen=True, slots=True, kw_only=True)
class TxnResult:
    # Per ``StepTxn.append_seq_ids`` entry, in order: the new tokens' slots, the block table after.
    append_slots: tuple[tuple[int, ...], ...]
    append_tables: tuple[tuple[int, ...], ...]
    copy_on_write: tuple[tuple[int, int], ...]
    swap_outs: tuple[SwapPlan, ...]  # in ``StepTxn.swap_outs`` order
    swap_ins: tuple[SwapPlan, ...]
    admitted: tuple[tuple[str, tuple[SlotGrant, ...]], ...]  # a prefix of the admissions
    pinned: tuple[tuple[int, PinnedPrefix | None], ...] = ()  # (pin id, what was pinned)
    # KV-tier copies (core/kv_tiers.py), in order: the tier store runs them before the step
    tier_ops: tuple[TierOp, ...] = ()
    snapshot: PoolSnapshot


# ---- the allocator core ---------------------------------------------------------------------


def apply_txn(pool: BlockPool, txn: StepTxn) -> TxnResult:
    """Apply one transaction to the pool (see the module docstring for order and guarantees)."""
    pool.begin_tier_txn()
    for swap_id in txn.complete_swaps:
        pool.complete_swap(swap_id)
    for parent, child in txn.forks:
        pool.fork(parent, child)
    pinned = []
    for pin in txn.pins:
        full = len(pin.token_ids) >= pool.block_size and pool.enable_prefix_caching
        pinned.append((pin.pin_id, pool.pin_prefix(pin.token_ids, pin.extra_key) if full else None))
    for pool_pin_id in txn.unpins:
        pool.unpin_prefix(pool_pin_id)
    for seq_id in txn.frees:
        pool.free(seq_id)
    for seq_id, num_tokens in txn.truncates:
        pool.truncate(seq_id, num_tokens)
    swap_outs = []
    for group in txn.swap_outs:
        plan = pool.swap_out(group)
        assert plan is not None, f"planned swap-out of {group} does not fit"
        swap_outs.append(plan)
    append_slots: list[tuple[int, ...]] = []
    cow: list[tuple[int, int]] = []
    drafts = txn.append_num_draft or (0,) * len(txn.append_seq_ids)
    appends = zip(txn.append_seq_ids, txn.append_token_ids, drafts, strict=True)
    for seq_id, token_ids, num_draft in appends:
        slot = pool.append_token(seq_id, token_ids[0]) if len(token_ids) == 1 else None
        if slot is not None:
            append_slots.append((slot,))
        else:
            result = pool.append(seq_id, token_ids, num_speculative_tokens=num_draft)
            assert result is not None, f"planned append to {seq_id} does not fit"
            cow.extend(result.copy_on_write)
            append_slots.append(result.slot_mapping)
    append_tables = tuple(map(pool.block_ids, txn.append_seq_ids))
    swap_ins = []
    for group in txn.swap_ins:
        plan = pool.swap_in(group)
        assert plan is not None, f"planned swap-in of {group} does not fit"
        swap_ins.append(plan)
    admitted = []
    for admission in txn.admissions:
        grants = _admit(pool, admission, txn.watermark_blocks)
        if grants is None:
            break
        admitted.append((admission.request_id, grants))
    admitted_groups = tuple(tuple(g.seq_id for g in grants) for _, grants in admitted)
    report = (*txn.report_groups, *admitted_groups)[-NUM_REPORTED_GROUPS:]
    return TxnResult(
        append_slots=tuple(append_slots),
        append_tables=append_tables,
        copy_on_write=tuple(cow),
        swap_outs=tuple(swap_outs),
        swap_ins=tuple(swap_ins),
        admitted=tuple(admitted),
        pinned=tuple(pinned),
        tier_ops=pool.drain_tier_ops(),
        snapshot=snapshot(pool, report),
    )


def _admit(pool: BlockPool, admission: Admission, watermark: int) -> tuple[SlotGrant, ...] | None:
    need = sum(
        pool.num_blocks_to_allocate(op.token_ids, max_new_tokens=op.max_new_tokens,
                                    extra_key=op.extra_key, read_cache=op.read_cache)
        for op in admission.ops
    )  # fmt: skip
    if need + watermark > pool.num_free_device_blocks:
        return None
    grants = []
    for op in admission.ops:
        alloc = pool.allocate(
            op.seq_id,
            op.token_ids,
            max_new_tokens=op.max_new_tokens,
            extra_key=op.extra_key,
            read_cache=op.read_cache,
        )
        assert alloc is not None, "capacity was checked"
        grants.append(_grant(pool, op.seq_id, alloc.num_cached_tokens, alloc.slot_mapping))
    return tuple(grants)


def _grant(pool: BlockPool, seq_id: int, cached: int, slots: tuple[int, ...]) -> SlotGrant:
    return SlotGrant(
        seq_id=seq_id,
        num_cached_tokens=cached,
        slot_mapping=slots,
        block_table=pool.block_ids(seq_id),
    )


def snapshot(pool: BlockPool, report_groups: tuple[tuple[int, ...], ...] = ()) -> PoolSnapshot:
    """The exact numbers the scheduler plans the next step with."""
    shared = pool.shared_tails()
    reports = []
    for group in report_groups:
        counts = pool.release_counts(group)
        if counts is not None:
            exclusive, distinct = counts
            reports.append(
                GroupReport(
                    seq_ids=group, num_exclusive_blocks=exclusive, num_distinct_blocks=distinct
                )
            )
    return PoolSnapshot(
        num_free_device_blocks=pool.num_free_device_blocks,
        num_free_host_blocks=pool.num_free_host_blocks,
        shared_tails=shared,
        groups=tuple(reports),
        statistics=pool.statistics(),
    )


__all__ = [
    "NUM_REPORTED_GROUPS",
    "Admission",
    "AllocateOp",
    "GroupReport",
    "PinOp",
    "PoolSnapshot",
    "SlotGrant",
    "StepTxn",
    "TxnResult",
    "apply_txn",
    "snapshot",
]
