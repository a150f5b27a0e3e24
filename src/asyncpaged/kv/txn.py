"""The step transaction between the scheduler and the allocator, and the allocator's side of it.

The scheduler owns the queues and decides what to run; the allocator owns the
:class:`BlockPool`, applies one :class:`StepTxn` per step atomically, and decides the one thing
only the pool can answer exactly: how far to preempt. In this order::

    placeholder_values -> complete_swaps -> forks -> pins -> unpins -> frees -> truncates
    -> [priority preemption] -> appends (preempting victims as they need) -> swap_ins -> admissions

Up to the appends everything is *mandatory*: planned against the exact :class:`PoolSnapshot`
the allocator returned after the previous transaction (nothing else consumes blocks in between),
it cannot fail (asserted). When the plan's needs fit the snapshot's free blocks the scheduler
sends no ``victims`` and every append and swap-in is mandatory too. Otherwise (memory pressure)
it sends the running groups newest first as ``victims`` and the appends grouped per request, in
queue order; the allocator then runs the paper's rule on the real pool: before each request's
appends, while they do not fit and blocks on their way back from swap-outs would not make them
fit, it preempts the next victim (swapped out when the host pool holds it and the mode is swap,
else freed to be recomputed), and it stops at a request that preempted itself or waits for
swap-outs. What a preemption frees is the pool's own count after doing it (shared blocks, a
victim's sharing with another, blocks the same transaction freed: all exact), and the result
says how many appends ran and which victims went. A transaction that preempted swaps nothing
in and admits nothing. *Admissions* are conditional: they are tried first come, first served,
each with the exact prefix-cache lookup, and the first one that does not fit (keeping
``watermark_blocks`` free) stops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import PinnedPrefix, PoolStatistics, SeqId, SwapPlan
from asyncpaged.kv.tiers import TierOp

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
class PriorityPreemption:
    """Priority policy: a waiting request outranks the first ``num_victims`` victims and needs
    ``num_seqs`` more sequences and ``blocks`` free device blocks than there are. The
    allocator preempts the fewest of those victims (from the front) whose sequences and released
    blocks cover both, or none when all of them would not."""

    num_victims: int
    num_seqs: int
    blocks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTxn:
    # Async scheduling: (seq id, value) of the placeholders earlier transactions appended
    # (``BlockPool.set_placeholder``), before anything else touches those sequences
    placeholder_values: tuple[tuple[int, int], ...] = ()
    complete_swaps: tuple[int, ...] = ()
    forks: tuple[tuple[int, int], ...] = ()  # (parent, child): never allocates
    pins: tuple[PinOp, ...] = ()  # prefixes whose request computed them (before its frees)
    unpins: tuple[int, ...] = ()
    frees: tuple[int, ...] = ()
    # Appends to running sequences, column-wise (one entry per sequence, no per-sequence
    # objects: a step appends to every running sequence): its id and the tokens it appends.
    append_seq_ids: tuple[int, ...] = ()
    append_token_ids: tuple[tuple[int, ...], ...] = ()
    # Per append entry (empty: none anywhere): how many of its last tokens are proposals to
    # verify (speculative decoding; ``BlockPool.append(num_speculative_tokens=...)``).
    append_num_draft: tuple[int, ...] = ()
    # (seq id, tokens kept) after a verification: the rejected proposals' slots roll back
    # (``BlockPool.truncate``), after the frees and before the appends.
    truncates: tuple[tuple[int, int], ...] = ()
    swap_ins: tuple[tuple[int, ...], ...] = ()
    admissions: tuple[Admission, ...] = ()
    watermark_blocks: int = 0
    # Memory pressure only (empty otherwise): every running group's live sequences, newest
    # (lowest ranked) first, the order preemption takes them in; the number of append entries
    # of each planned request, in queue order; and how a victim goes.
    victims: tuple[tuple[int, ...], ...] = ()
    append_group_sizes: tuple[int, ...] = ()
    swap_victims: bool = False  # swap a victim out when the host pool holds it, else recompute
    preemption: PriorityPreemption | None = None


@dataclass(slots=True)
class PendingOps:
    """The pool operations decided since the last transaction, waiting for the next one: the
    mandatory head of the next :class:`StepTxn` (a plan adds its appends, swap-ins and
    admissions). Fields as in :class:`StepTxn`; the scheduler appends to them as it decides."""

    placeholder_values: list[tuple[int, int]] = field(default_factory=list)
    complete_swaps: list[int] = field(default_factory=list)
    forks: list[tuple[int, int]] = field(default_factory=list)
    pins: list[PinOp] = field(default_factory=list)
    unpins: list[int] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    truncates: list[tuple[int, int]] = field(default_factory=list)

    @property
    def can_flush(self) -> bool:
        """Whether :meth:`flush` has something to send (frees, placeholders' values, pins,
        unpins, swap confirmations)."""
        return bool(
            self.frees or self.placeholder_values or self.pins or self.unpins or self.complete_swaps
        )

    @property
    def has_work(self) -> bool:
        """Whether anything waits for the next transaction."""
        return self.can_flush or bool(self.forks or self.truncates)

    def flush(self) -> StepTxn:
        """A transaction of everything pending but the truncates (they wait for the plan that
        follows the verification), which leaves this empty but for them."""
        txn = StepTxn(
            placeholder_values=tuple(self.placeholder_values),
            complete_swaps=tuple(self.complete_swaps), forks=tuple(self.forks),
            pins=tuple(self.pins), unpins=tuple(self.unpins), frees=tuple(self.frees),
        )  # fmt: skip
        self.placeholder_values, self.complete_swaps, self.forks = [], [], []
        self.pins, self.unpins, self.frees = [], [], []
        return txn


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotGrant:
    """Slots for one sequence's new tokens, and its block table afterwards."""

    seq_id: int
    num_cached_tokens: int
    slot_mapping: tuple[int, ...]
    block_table: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSnapshot:
    """The pool's state after a transaction: exact, since only transactions change it."""

    num_free_device_blocks: int
    num_free_host_blocks: int
    shared_tails: frozenset[SeqId]  # device sequences whose partial last block is shared
    statistics: PoolStatistics


@dataclass(frozen=True, slots=True, kw_only=True)
class TxnResult:
    # Per ``StepTxn.append_seq_ids`` entry that ran (a prefix of them, all without pressure),
    # in order: the new tokens' slots, the block table after.
    append_slots: tuple[tuple[int, ...], ...]
    append_tables: tuple[tuple[int, ...], ...]
    copy_on_write: tuple[tuple[int, int], ...]
    # One entry per victim preempted, from the front of ``StepTxn.victims``: True if it was
    # swapped out (its plan in ``swap_outs``, in the same order), False if freed to recompute.
    preempted: tuple[bool, ...]
    swap_outs: tuple[SwapPlan, ...]
    swap_ins: tuple[SwapPlan, ...]
    admitted: tuple[tuple[str, tuple[SlotGrant, ...]], ...]  # a prefix of the admissions
    pinned: tuple[tuple[int, PinnedPrefix | None], ...] = ()  # (pin id, what was pinned)
    # KV-tier copies (kv/tiers.py), in order: the tier store runs them before the step
    tier_ops: tuple[TierOp, ...] = ()
    snapshot: PoolSnapshot


# ---- the allocator core ---------------------------------------------------------------------


def apply_txn(pool: BlockPool, txn: StepTxn) -> TxnResult:
    """Apply one transaction to the pool (see the module docstring for order and guarantees)."""
    pool.begin_tier_txn()
    for seq_id, token in txn.placeholder_values:
        pool.set_placeholder(seq_id, token)
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
    appended = _Appended()
    if txn.victims:
        _appends_under_pressure(pool, txn, appended)
    else:
        _append(pool, txn, range(len(txn.append_seq_ids)), appended)
    append_tables = pool.block_ids_of(txn.append_seq_ids[: len(appended.slots)])
    swap_ins = []
    for group in () if appended.preempted else txn.swap_ins:
        plan = pool.swap_in(group)
        assert plan is not None, f"planned swap-in of {group} does not fit"
        swap_ins.append(plan)
    admitted = []
    for admission in () if appended.preempted else txn.admissions:
        grants = _admit(pool, admission, txn.watermark_blocks)
        if grants is None:
            break
        admitted.append((admission.request_id, grants))
    return TxnResult(
        append_slots=tuple(appended.slots),
        append_tables=append_tables,
        copy_on_write=tuple(appended.cow),
        preempted=tuple(appended.preempted),
        swap_outs=tuple(appended.swap_outs),
        swap_ins=tuple(swap_ins),
        admitted=tuple(admitted),
        pinned=tuple(pinned),
        tier_ops=pool.drain_tier_ops(),
        snapshot=snapshot(pool),
    )


@dataclass(slots=True)
class _Appended:
    """What the appends of a transaction did so far."""

    slots: list[tuple[int, ...]] = field(default_factory=list)
    cow: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[bool] = field(default_factory=list)
    swap_outs: list[SwapPlan] = field(default_factory=list)


def _append(pool: BlockPool, txn: StepTxn, entries: range, out: _Appended) -> None:
    """Run these append entries (each fits: checked by the caller or planned)."""
    ids, tokens, drafts = txn.append_seq_ids, txn.append_token_ids, txn.append_num_draft
    for i in entries:
        seq_id, token_ids = ids[i], tokens[i]
        num_draft = drafts[i] if drafts else 0
        slot = pool.append_token(seq_id, token_ids[0]) if len(token_ids) == 1 else None
        if slot is not None:
            out.slots.append((slot,))
            continue
        result = pool.append(seq_id, token_ids, num_speculative_tokens=num_draft)
        assert result is not None, f"planned append to {seq_id} does not fit"
        out.cow.extend(result.copy_on_write)
        out.slots.append(result.slot_mapping)


def _appends_under_pressure(pool: BlockPool, txn: StepTxn, out: _Appended) -> None:
    """The appends request by request, preempting victims (newest first) as they need."""
    victims = iter(txn.victims)
    gone: set[int] = set()  # sequences of the victims preempted so far

    def preempt() -> bool:
        group = next(victims, None)
        if group is None:
            return False
        plan = pool.swap_out(group) if txn.swap_victims else None
        if plan is None:  # recompute (also when the host pool cannot hold it)
            for seq_id in group:
                pool.free(seq_id)
        else:
            out.swap_outs.append(plan)
        out.preempted.append(plan is not None)
        gone.update(group)
        return True

    if txn.preemption is not None:
        for _ in range(_num_preempted_for(pool, txn.victims, txn.preemption)):
            preempt()
    ids, tokens = txn.append_seq_ids, txn.append_token_ids
    start = 0
    for size in txn.append_group_sizes:
        entries = range(start, start + size)
        if gone.intersection(ids[i] for i in entries):
            return  # preempted (for a priority preemption, or by an older one): so are newer
        need = pool.num_blocks_to_append_all([(ids[i], len(tokens[i])) for i in entries])
        while need > (free := pool.num_free_device_blocks) and need > free + pool.num_blocks_coming:
            if not preempt() or gone.intersection(ids[i] for i in entries):
                return  # it preempted itself
        if need > pool.num_free_device_blocks:
            return  # it waits for swap-outs to complete, and so do newer requests
        _append(pool, txn, entries, out)
        start += size


def _num_preempted_for(
    pool: BlockPool, victims: tuple[tuple[int, ...], ...], preemption: PriorityPreemption
) -> int:
    """The fewest victims from the front whose preemption gives ``preemption`` its sequences and
    blocks (released blocks counted once however the victims share them); 0 if all cannot."""
    seq_ids: list[int] = []
    free = pool.num_free_device_blocks
    for n, group in enumerate(victims[: preemption.num_victims], 1):
        seq_ids.extend(group)
        counts = pool.release_counts(seq_ids)
        assert counts is not None, f"victim {group} is not on the device"
        if len(seq_ids) >= preemption.num_seqs and free + counts[0] >= preemption.blocks:
            return n
    return 0


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


def snapshot(pool: BlockPool) -> PoolSnapshot:
    """The exact numbers the scheduler plans the next step with."""
    return PoolSnapshot(
        num_free_device_blocks=pool.num_free_device_blocks,
        num_free_host_blocks=pool.num_free_host_blocks,
        shared_tails=pool.shared_tails(),
        statistics=pool.statistics(),
    )


__all__ = [
    "Admission",
    "AllocateOp",
    "PinOp",
    "PoolSnapshot",
    "PriorityPreemption",
    "SlotGrant",
    "StepTxn",
    "TxnResult",
    "apply_txn",
    "snapshot",
]
