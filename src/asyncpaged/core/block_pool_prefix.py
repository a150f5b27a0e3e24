"""The prefix cache's side of the block pool: the hash chain of a table's full blocks, matching
a prompt's leading full blocks against the device cache (a lookup's :class:`PrefixHit`) and
then the lower KV tiers (core/kv_tiers.py), restoring tier hits into new device blocks,
registering full blocks, pinning a prefix's cached blocks and unpinning them, and copying the
cached blocks down to the tiers at shutdown.

Functions of the device pool, tier index, tables and pins they are given (the
:class:`~asyncpaged.core.block_pool.BlockPool` passes its own); with prefix caching off the
pool has no tiers, nothing matches, and no block is hashed or registered.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from asyncpaged.core.block_pool_checks import check_tokens
from asyncpaged.core.block_table import BlockTable, PinnedPrefix, PrefixHit
from asyncpaged.core.kv_tiers import TierIndex, TierOp
from asyncpaged.core.physical_blocks import PhysicalBlocks
from asyncpaged.core.prefix_hash import ROOT_HASH, BlockHash, hash_block
from asyncpaged.errors import BlockPoolError


class PromptHashes:
    """The hash chains of recent prompts' full blocks, so that admitting a prompt hashes each
    of its blocks once: its size check, its allocation and the blocks its first chunk fills all
    read the same chain (one tuple: the allocator's ``AllocateOp.token_ids``). A prompt that
    waits for memory is offered again as a new tuple each step and hashed again, up to its
    first block the cache lacks.

    Keyed by the identity of the prompt's token tuple (only tuples: they cannot change), with
    the tuple held so that its id is not reused while the entry lives; a chain is a pure
    function of the tokens, the extra key and the block size, so an entry never goes stale.
    The entries hold at most ``max_tokens`` prompt tokens in all (a transaction's admissions
    fit; a finished request's prompt is not kept alive for long), the oldest dropped first;
    one prompt longer than that is still kept, alone.
    """

    def __init__(self, block_size: int, max_tokens: int = 1 << 16) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self._chains: dict[int, tuple[tuple[int, ...], str | None, HashChain]] = {}
        self._num_tokens = 0

    def of(self, token_ids: Sequence[int], extra_key: str | None) -> HashChain | None:
        """The hash chain of ``token_ids``' full blocks; None for a non-tuple."""
        if type(token_ids) is not tuple:
            return None
        entry = self._chains.get(id(token_ids))
        if entry is not None and entry[0] is token_ids and entry[1] == extra_key:
            return entry[2]
        hashes = HashChain(token_ids, extra_key, self.block_size)
        if entry is not None:  # the same tuple under another extra key: replaced
            self._num_tokens -= len(self._chains.pop(id(token_ids))[0])
        while self._chains and self._num_tokens + len(token_ids) > self.max_tokens:
            self._num_tokens -= len(self._chains.pop(next(iter(self._chains)))[0])
        self._chains[id(token_ids)] = (token_ids, extra_key, hashes)
        self._num_tokens += len(token_ids)
        return hashes

    @property
    def num_tokens(self) -> int:
        """Prompt tokens the entries hold (their tuples are kept alive)."""
        return self._num_tokens


class HashChain:
    """The hashes of a prompt's full blocks, each computed on first use (a size check reads
    them only up to the first block the cache lacks) and kept."""

    __slots__ = ("_block_size", "_extra_key", "_hashes", "_token_ids", "num_blocks")

    def __init__(self, token_ids: tuple[int, ...], extra_key: str | None, block_size: int):
        self._token_ids, self._extra_key, self._block_size = token_ids, extra_key, block_size
        self._hashes: list[BlockHash] = []
        self.num_blocks = len(token_ids) // block_size

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> BlockHash:
        if not 0 <= index < self.num_blocks:
            raise IndexError(index)
        hashes, bs = self._hashes, self._block_size
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(
                hash_block(parent, self._token_ids[i * bs : (i + 1) * bs], self._extra_key)
            )
        return hashes[index]


def match_prefix(
    device: PhysicalBlocks,
    token_ids: Sequence[int],
    extra_key: str | None,
    num_blocks: int | None = None,
    *,
    caching: bool,
    chain: HashChain | None = None,
) -> tuple[list[int], list[BlockHash]]:
    """Cached blocks (and their hashes) for the leading full blocks of ``token_ids``, at most
    ``num_blocks`` of them; none unless ``caching``. ``chain``: the prompt's hashes, if known
    (``PromptHashes``).

    By default the last token is excluded: a prompt needs the logits of its last token.
    """
    if not caching:
        return [], []
    bs = device.block_size
    if num_blocks is None:
        num_blocks = (len(token_ids) - 1) // bs
    blocks: list[int] = []
    hashes: list[BlockHash] = []
    parent = ROOT_HASH
    for i in range(num_blocks):
        if chain is not None:
            parent = chain[i]
        else:
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra_key)
        block = device.lookup(parent)
        if block is None:
            break
        blocks.append(block)
        hashes.append(parent)
    return blocks, hashes


def lookup(
    device: PhysicalBlocks, token_ids: Sequence[int], extra_key: str | None, *, caching: bool
) -> PrefixHit:
    """The :class:`PrefixHit` of a prompt: the cached blocks :func:`match_prefix` maps in."""
    blocks, _ = match_prefix(device, token_ids, extra_key, caching=caching)
    return PrefixHit(block_ids=tuple(blocks), num_tokens=len(blocks) * device.block_size)


def match_full_blocks(
    device: PhysicalBlocks, token_ids: Sequence[int], extra_key: str | None
) -> list[int] | None:
    """The cached blocks of every full block of ``token_ids`` (a prefix to pin, prefix caching
    on), or None unless all of them are cached; raises unless there is a full block."""
    bs = device.block_size
    num_full = len(token_ids) // bs
    if num_full == 0:
        raise BlockPoolError(
            f"a pinned prefix needs at least one full block of {bs} tokens, "
            f"got {len(token_ids)} tokens."
        )
    blocks, _ = match_prefix(device, token_ids, extra_key, num_blocks=num_full, caching=True)
    return blocks if len(blocks) == num_full else None


def match_tiers(
    device: PhysicalBlocks,
    tiers: TierIndex | None,
    token_ids: Sequence[int],
    extra_key: str | None,
    device_hashes: list[BlockHash],
    chain: HashChain | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks after the device hits that a lower tier holds, up to the
    first that none does (or that is on the device); never the prompt's last token.
    ``chain``: the prompt's hashes, if known."""
    if tiers is None:
        return []
    bs = device.block_size
    found: list[BlockHash] = []
    parent = device_hashes[-1] if device_hashes else ROOT_HASH
    for i in range(len(device_hashes), (len(token_ids) - 1) // bs):
        if chain is not None:
            parent = chain[i]
        else:
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra_key)
        if device.lookup(parent) is not None or tiers.lookup(parent) is None:
            break
        found.append(parent)
    return found


def restore_from_tiers(
    device: PhysicalBlocks,
    tiers: TierIndex,
    table: BlockTable,
    hashes: list[BlockHash],
    tier_hit_tokens: dict[str, int],
) -> None:
    """Give ``table`` a new, registered device block per tier hit and record each copy (and
    its tokens in ``tier_hit_tokens``, per tier). Taking a block may evict (offload) another:
    the entries being restored are protected from the tiers' own evictions meanwhile."""
    bs = device.block_size
    for block_hash in hashes:
        tiers.protect(block_hash)
    for block_hash in hashes:
        block = device.take(after=table.block_ids[-1] if table.block_ids else None)
        device.fill(block, bs)
        registered = device.register(block, block_hash)
        assert registered, "a restored block's hash is already on the device"
        tier_hit_tokens[tiers.restore(block_hash, block)] += bs
        table.block_ids.append(block)
        table.block_hashes.append(block_hash)


def seal_full_block(table: BlockTable, chain: HashChain | None = None) -> BlockHash:
    """Chain the hash of the table's just-filled last block (its ``partial_token_ids``), append
    it to ``block_hashes`` and start a new, empty partial block; returns the hash (the caller
    registers the block or not). ``chain``: the hashes of the table's prompt, when these are
    its tokens (an allocation); the block's hash is then read, not computed."""
    index = len(table.block_hashes)
    if chain is not None and index < len(chain):
        block_hash = chain[index]
    else:
        parent = table.block_hashes[-1] if table.block_hashes else ROOT_HASH
        block_hash = hash_block(parent, table.partial_token_ids, table.extra_key)
    table.block_hashes.append(block_hash)
    table.partial_token_ids.clear()
    return block_hash


def register_full_blocks(device: PhysicalBlocks, table: BlockTable, first: int = 0) -> None:
    """Register in the prefix cache the table's full blocks from index ``first`` on that are
    not registered yet (verified speculative blocks, blocks swapped back in)."""
    block_ids, block_hashes = table.block_ids, table.block_hashes
    for i in range(first, len(block_hashes)):
        if device.hash_of(block_ids[i]) is None:
            device.register(block_ids[i], block_hashes[i])


def persist_to_tiers(
    device: PhysicalBlocks, tiers: TierIndex | None, pinned: Iterable[tuple[int, ...]]
) -> tuple[TierOp, ...]:
    """Offload every cached device block (least recently used first, then the ``pinned``
    ones) and persist the tiers; returns the tier copies to run (none without tiers)."""
    if tiers is None:
        return ()
    pinned_blocks = [b for blocks in pinned for b in blocks]
    for block in (*device.evictable_blocks(), *dict.fromkeys(pinned_blocks)):
        block_hash = device.hash_of(block)
        assert block_hash is not None, f"cached block {block} has no hash"
        tiers.offload(block, block_hash)
    tiers.persist()
    return tiers.drain_ops()


def pin_full_blocks(
    device: PhysicalBlocks,
    pins: dict[int, tuple[int, ...]],
    ids: Iterator[int],
    token_ids: Sequence[int],
    extra_key: str | None,
    *,
    caching: bool,
) -> PinnedPrefix | None:
    """Hold the cached device blocks of every full block of ``token_ids`` (one reference each)
    as a pin, its id the next of ``ids``, recorded in ``pins``; None, changing nothing, unless
    all are cached. Raises without prefix ``caching``."""
    if not caching:
        raise BlockPoolError("pin_prefix needs enable_prefix_caching=True.")
    check_tokens(token_ids)
    blocks = match_full_blocks(device, token_ids, extra_key)
    if blocks is None:
        return None
    for block in blocks:
        device.incref(block)
    num_tokens = len(blocks) * device.block_size
    pin = PinnedPrefix(pin_id=next(ids), block_ids=tuple(blocks), num_tokens=num_tokens)
    pins[pin.pin_id] = pin.block_ids
    return pin


def unpin(device: PhysicalBlocks, pins: dict[int, tuple[int, ...]], pin_id: int) -> None:
    """Drop pin ``pin_id`` from ``pins`` and release its blocks; raises for an unknown id."""
    if pin_id not in pins:
        raise BlockPoolError(f"no pinned prefix with id {pin_id}.")
    device.release(pins.pop(pin_id))
