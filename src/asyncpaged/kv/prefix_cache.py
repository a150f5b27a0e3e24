"""The prefix cache of a block pool: the hash chain of a prompt's full blocks, matching a
prompt's leading full blocks against the device cache (a lookup's :class:`PrefixHit`) and then
the lower KV tiers (kv/tiers.py), restoring tier hits into new device blocks, registering
full blocks, pinned prefixes, and copying the cached blocks down to the tiers at shutdown.

:class:`PrefixCache` is a class of its own, held by the
:class:`~asyncpaged.kv.block_pool.BlockPool`: it owns what only the cache reads (the prompt
hash memo, the tier index, the pins) and works through the device pool's public registry
(:meth:`PhysicalBlocks.lookup`, :meth:`~PhysicalBlocks.register`). With prefix caching off it
has no tiers, nothing matches, and no block is hashed or registered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

from asyncpaged.errors import BlockPoolError
from asyncpaged.kv.block_table import BlockTable, PinnedPrefix, PrefixHit
from asyncpaged.kv.physical_blocks import PhysicalBlocks
from asyncpaged.kv.prefix_hash import ROOT_HASH, BlockHash, hash_block
from asyncpaged.kv.tiers import TierIndex, TierName, TierOp

__all__ = ["HashChain", "PrefixCache", "PromptHashes"]


class PrefixCache:
    """The device prefix cache's matching, registration, tiers and pins.

    Invariants (checked by the pool): a pin holds one reference on each of its blocks, all of
    them registered; only full device blocks are registered, under the chained hash of their
    tokens and extra key; the last token of a prompt is never matched.
    """

    def __init__(self, device: PhysicalBlocks, tiers: TierIndex | None, *, enabled: bool) -> None:
        self.device = device
        self.block_size = device.block_size
        self.enabled = enabled
        self.tiers = tiers if enabled else None
        self.prompt_hashes = PromptHashes(device.block_size)  # a cache of a pure function
        self._pins: dict[int, tuple[int, ...]] = {}
        if self.tiers is not None:
            device.on_evict = self.tiers.offload

    # ---- matching -------------------------------------------------------------------------

    def chain_of(self, token_ids: Sequence[int], extra_key: str | None) -> HashChain | None:
        """The memoized hash chain of a prompt (None: not a tuple, or caching off)."""
        return self.prompt_hashes.of(token_ids, extra_key) if self.enabled else None

    def match(
        self,
        token_ids: Sequence[int],
        extra_key: str | None,
        num_blocks: int | None = None,
        chain: HashChain | None = None,
    ) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks (and their hashes) for the leading full blocks of ``token_ids``, at most
        ``num_blocks`` of them; none with caching off. ``chain``: the prompt's hashes, if known
        (``PromptHashes``).

        By default the last token is excluded: a prompt needs the logits of its last token.
        """
        if not self.enabled:
            return [], []
        device, bs = self.device, self.block_size
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

    def lookup(self, token_ids: Sequence[int], extra_key: str | None) -> PrefixHit:
        """The :class:`PrefixHit` of a prompt: the cached blocks :meth:`match` maps in."""
        blocks, _ = self.match(token_ids, extra_key)
        return PrefixHit(block_ids=tuple(blocks), num_tokens=len(blocks) * self.block_size)

    def match_tiers(
        self,
        token_ids: Sequence[int],
        extra_key: str | None,
        device_hashes: list[BlockHash],
        chain: HashChain | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks after the device hits that a lower tier holds, up to the
        first that none does (or that is on the device); never the prompt's last token.
        ``chain``: the prompt's hashes, if known."""
        tiers = self.tiers
        if tiers is None:
            return []
        device, bs = self.device, self.block_size
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

    # ---- writing --------------------------------------------------------------------------

    def restore(self, table: BlockTable, hashes: list[BlockHash]) -> list[TierName]:
        """Give ``table`` a new, registered device block per tier hit (``hashes``, found by
        :meth:`match_tiers`) and record each copy; returns the tier each came from. Taking a
        block may evict (offload) another: the entries being restored are protected from the
        tiers' own evictions meanwhile."""
        tiers = self.tiers
        assert tiers is not None
        device, bs = self.device, self.block_size
        for block_hash in hashes:
            tiers.protect(block_hash)
        sources: list[TierName] = []
        for block_hash in hashes:
            block = device.take(after=table.block_ids[-1] if table.block_ids else None)
            device.fill(block, bs)
            registered = device.register(block, block_hash)
            assert registered, "a restored block's hash is already on the device"
            sources.append(tiers.restore(block_hash, block))
            table.block_ids.append(block)
            table.block_hashes.append(block_hash)
        return sources

    @staticmethod
    def seal_full_block(table: BlockTable, chain: HashChain | None = None) -> BlockHash:
        """Chain the hash of the table's just-filled last block (its ``partial_token_ids``),
        append it to ``block_hashes`` and start a new, empty partial block; returns the hash
        (the caller registers the block or not). ``chain``: the hashes of the table's prompt,
        when these are its tokens (an allocation); the block's hash is then read, not
        computed."""
        index = len(table.block_hashes)
        if chain is not None and index < len(chain):
            block_hash = chain[index]
        else:
            parent = table.block_hashes[-1] if table.block_hashes else ROOT_HASH
            block_hash = hash_block(parent, table.partial_token_ids, table.extra_key)
        table.block_hashes.append(block_hash)
        table.partial_token_ids.clear()
        return block_hash

    def register_full_blocks(self, table: BlockTable, first: int = 0) -> None:
        """Register the device table's full blocks from index ``first`` on that are not
        registered yet (verified speculative blocks, blocks swapped back in)."""
        device = self.device
        block_ids, block_hashes = table.block_ids, table.block_hashes
        for i in range(first, len(block_hashes)):
            if device.hash_of(block_ids[i]) is None:
                device.register(block_ids[i], block_hashes[i])

    # ---- pins -----------------------------------------------------------------------------

    @property
    def pins(self) -> Mapping[int, tuple[int, ...]]:
        """A read-only view of the pinned prefixes: pin id -> its device blocks."""
        return MappingProxyType(self._pins)

    def pin(
        self, token_ids: Sequence[int], extra_key: str | None, ids: Iterator[int]
    ) -> PinnedPrefix | None:
        """Hold the cached device blocks of every full block of ``token_ids`` (one reference
        each) as a pin, its id the next of ``ids``; None, changing nothing, unless all are
        cached. Raises with caching off, for no tokens, or for no full block."""
        if not self.enabled:
            raise BlockPoolError("pin_prefix needs enable_prefix_caching=True.")
        if len(token_ids) == 0:
            raise BlockPoolError("token_ids must not be empty.")
        device, bs = self.device, self.block_size
        num_full = len(token_ids) // bs
        if num_full == 0:
            raise BlockPoolError(
                f"a pinned prefix needs at least one full block of {bs} tokens, "
                f"got {len(token_ids)} tokens."
            )
        blocks, _ = self.match(token_ids, extra_key, num_blocks=num_full)
        if len(blocks) != num_full:
            return None
        for block in blocks:
            device.incref(block)
        pin = PinnedPrefix(pin_id=next(ids), block_ids=tuple(blocks), num_tokens=num_full * bs)
        self._pins[pin.pin_id] = pin.block_ids
        return pin

    def unpin(self, pin_id: int) -> None:
        """Drop pin ``pin_id`` and release its blocks; raises for an unknown id."""
        if pin_id not in self._pins:
            raise BlockPoolError(f"no pinned prefix with id {pin_id}.")
        self.device.release(self._pins.pop(pin_id))

    # ---- the tiers ------------------------------------------------------------------------

    def persist(self) -> tuple[TierOp, ...]:
        """Offload every cached device block (least recently used first, then the pinned
        ones) and persist the tiers; returns the tier copies to run (none without tiers)."""
        tiers = self.tiers
        if tiers is None:
            return ()
        device = self.device
        pinned_blocks = [b for blocks in self._pins.values() for b in blocks]
        for block in (*device.evictable_blocks(), *dict.fromkeys(pinned_blocks)):
            block_hash = device.hash_of(block)
            assert block_hash is not None, f"cached block {block} has no hash"
            tiers.offload(block, block_hash)
        tiers.persist()
        return tiers.drain_ops()


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
