"""The KV tiers' data: a host-RAM block cache and a directory of block files.

The index (``kv/tiers.py``) decides; :class:`KVTierStore` replays its ops, in order, in the
swap-space actor's thread before the step that follows their transaction.

Disk entry format (one file per block, ``<kv_offload_dir>/<identity[:16]>/<block hash>.kv``)::

    offset  size  field
    0       8     magic b"APKVTIER"
    8       4     format version (little-endian u32, 1)
    12      32    model identity: sha256 of the checkpoint path, config.json's sha256, the
                  weights files' names, sizes and mtimes, the KV dtype (and a quantized
                  cache's scale dtype), block size and KV shape
    44      32    the block's chained prefix hash (the device cache's salted sha256 chain)
    76      8     payload length in bytes (u64)
    84      32    sha256 of the payload
    116     ...   payload: the block's K ([layers, kv_heads, head_dim, block_size]) then V
                  ([layers, kv_heads, block_size, head_dim]), raw, in the KV dtype; a
                  quantized cache's K then V scales ([layers, kv_heads, block_size]) follow

A file is written to a temporary name and renamed, so a reader never sees half a file. At start
every file is checked (magic, version, identity, hash, length, checksum); one of another model
(another identity: its own directory, or a header that does not match) is left alone and never
read; a truncated or corrupted one of ours is deleted. A write that
fails (a full disk) leaves no entry. Either way it is a miss, never wrong K/V.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from asyncpaged._log import get_logger
from asyncpaged.kv.prefix_hash import BlockHash
from asyncpaged.kv.tiers import (
    DropDiskOp,
    OffloadOp,
    RestoreDiskOp,
    RestoreHostOp,
    SpillOp,
    TierIndex,
    TierOp,
)
from asyncpaged.model.kv_cache import KVLayout, PagedKVCache, swap_blocks
from asyncpaged.model.kv_quant import KV_SCALE_DTYPE, is_quantized

log = get_logger(__name__)

MAGIC = b"APKVTIER"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sI32s32sQ32s")


class KVTierError(RuntimeError):
    """A disk entry that was verified at start no longer reads back (changed under the
    running engine): the engine fails rather than use wrong K/V."""


def model_identity(
    model_path: str | Path,
    kv_dtype: torch.dtype,
    block_size: int,
    kv_shape: tuple[int, int, int],
    layout: KVLayout = "runner",
) -> bytes:
    """What a disk entry must match to be reused: the checkpoint (path, config, weights files)
    and the cache's layout (dtype, block size, layers / KV heads / head dim, and how a block's
    K and V lie: an entry holds the block's bytes). The runner layout adds nothing to the
    document, so the entries written before layouts existed stay valid; a quantized dtype adds
    its scales' dtype. An entry written with another KV dtype is another model's: never read."""
    path = Path(model_path).resolve()
    config = path / "config.json"
    config_hash = hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else ""
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in path.iterdir()
        if p.suffix in (".safetensors", ".bin")
    )
    doc: dict[str, object] = {
        "format": FORMAT_VERSION,
        "model": str(path),
        "config_sha256": config_hash,
        "weights": weights,
        "kv_dtype": str(kv_dtype),
        "block_size": block_size,
        "kv_shape": list(kv_shape),
    }
    if layout != "runner":
        doc["kv_layout"] = layout
    if is_quantized(kv_dtype):
        doc["kv_scale_dtype"] = str(KV_SCALE_DTYPE)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()


class DiskTier:
    """Block files in one directory, each checked on read (see the module docstring)."""

    def __init__(self, root: str | Path, identity: bytes, payload_bytes: int) -> None:
        """Entries live in ``root/<first 16 hex digits of the identity>/``, so models sharing
        ``root`` never touch each other's files (the header's identity is checked still)."""
        self.directory = Path(root) / identity.hex()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.entry_bytes = HEADER.size + payload_bytes

    def path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}.kv"

    def scan(self, budget_entries: int) -> list[BlockHash]:
        """This model's readable entries, least recently used (oldest mtime) first; deletes
        our corrupted or truncated files, and the oldest entries beyond the budget."""
        found: list[tuple[int, BlockHash]] = []
        for path in self.directory.glob("*.kv"):
            try:
                block_hash = bytes.fromhex(path.stem)
                data = path.read_bytes()
                mtime = path.stat().st_mtime_ns
            except (ValueError, OSError):
                continue
            verdict = self._check(block_hash, data)
            if verdict == "ok":
                found.append((mtime, block_hash))
            elif verdict == "corrupt":
                log.warning("kv_tier_entry_dropped", path=str(path), reason="corrupt")
                path.unlink(missing_ok=True)
        found.sort()
        keep = [h for _, h in found]
        for block_hash in keep[: max(0, len(keep) - budget_entries)]:
            self.path(block_hash).unlink(missing_ok=True)
        return keep[max(0, len(keep) - budget_entries) :]

    def write(self, block_hash: BlockHash, payload: bytes) -> bool:
        """Write one entry atomically; False (and nothing left behind) if the disk refuses."""
        assert len(payload) == self.payload_bytes
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.identity, block_hash, len(payload),
                             hashlib.sha256(payload).digest())  # fmt: skip
        path = self.path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("kv_tier_write_failed", path=str(path), error=str(exc))
            return False
        return True

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The payload of a valid entry of this model, or None."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if self._check(block_hash, data) != "ok":
            return None
        os.utime(path)  # most recently used, for the next start's order
        return data[HEADER.size :]

    def drop(self, block_hash: BlockHash) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def _check(self, block_hash: BlockHash, data: bytes) -> str:
        """ "ok", "foreign" (not ours: another model or format) or "corrupt"."""
        if len(data) < HEADER.size:
            return "corrupt" if data.startswith(MAGIC) or MAGIC.startswith(data) else "foreign"
        magic, version, identity, stored_hash, length, checksum = HEADER.unpack_from(data)
        if magic != MAGIC or version != FORMAT_VERSION or identity != self.identity:
            return "foreign"
        payload = data[HEADER.size :]
        if (
            stored_hash != block_hash
            or length != self.payload_bytes
            or len(payload) != length
            or hashlib.sha256(payload).digest() != checksum
        ):
            return "corrupt"
        return "ok"


class KVTierStore:
    """Host tier blocks (same layout as the device cache) and the disk tier; replays ops.

    Invariants: only :meth:`run` touches the data, from one thread at a time (the swap-space
    actor's), while no step runs; ``_failed_spills`` holds the hashes whose files could not be
    written and is drained by the allocator before its next transaction.
    """

    def __init__(
        self, device_cache: PagedKVCache, num_host_slots: int, disk: DiskTier | None = None
    ) -> None:
        self.device_cache = device_cache
        self.host = PagedKVCache(
            num_layers=device_cache.num_layers,
            num_blocks=num_host_slots,
            block_size=device_cache.block_size,
            num_kv_heads=device_cache.num_kv_heads,
            head_dim=device_cache.head_dim,
            dtype=device_cache.dtype,
            device="cpu",
            pin_memory=device_cache.key.device.type == "cuda",
            layout=device_cache.layout,
        )
        self.disk = disk
        self._failed_spills: list[BlockHash] = []
        self._lock = threading.Lock()

    @property
    def has_disk(self) -> bool:
        return self.disk is not None

    def take_failed_spills(self) -> list[BlockHash]:
        with self._lock:
            failed, self._failed_spills = self._failed_spills, []
        return failed

    def run(self, ops: Sequence[TierOp]) -> None:
        """Replay ops in order; consecutive host copies of one direction go in one batch."""
        i = 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op, OffloadOp | RestoreHostOp):
                j, pairs = _batch(ops, i, type(op))
                if isinstance(op, OffloadOp):
                    swap_blocks(self.device_cache, self.host, pairs)
                else:
                    swap_blocks(self.host, self.device_cache, pairs)
                i = j
                continue
            if isinstance(op, SpillOp):
                self._spill(op)
            elif isinstance(op, RestoreDiskOp):
                self._restore_disk(op)
            else:
                assert isinstance(op, DropDiskOp)
                assert self.disk is not None
                self.disk.drop(op.block_hash)
            i += 1

    def _spill(self, op: SpillOp) -> None:
        assert self.disk is not None
        payload = block_bytes(self.host, op.host_slot)
        if not self.disk.write(op.block_hash, payload):
            with self._lock:
                self._failed_spills.append(op.block_hash)

    def _restore_disk(self, op: RestoreDiskOp) -> None:
        assert self.disk is not None
        payload = self.disk.read(op.block_hash)
        if payload is None:
            raise KVTierError(
                f"KV tier entry {self.disk.path(op.block_hash)} was verified but no longer "
                "reads back (changed while the engine ran)."
            )
        load_block(self.device_cache, op.device_block, payload)


def block_bytes(cache: PagedKVCache, block: int) -> bytes:
    """One block's K then V (then a quantized cache's K and V scales), every layer, as raw
    bytes."""
    parts = [t[:, block].contiguous().cpu().view(torch.uint8) for t in cache.tensors]
    return b"".join(part.numpy().tobytes() for part in parts)


def load_block(cache: PagedKVCache, block: int, payload: bytes) -> None:
    """The inverse of :func:`block_bytes`."""
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    start = 0
    for tensor in cache.tensors:
        shape = (tensor.shape[0], *tensor.shape[2:])
        size = math.prod(shape) * tensor.element_size()
        part = raw[start : start + size].view(tensor.dtype).view(shape)
        tensor[:, block] = part.to(tensor.device)
        start += size
    assert start == raw.numel(), f"a payload of {raw.numel()} bytes for blocks of {start}"


def _batch(
    ops: Sequence[TierOp], start: int, kind: type[OffloadOp] | type[RestoreHostOp]
) -> tuple[int, list[tuple[int, int]]]:
    """The run of ``kind`` ops from ``start`` with distinct destinations, as (src, dst)."""
    pairs: list[tuple[int, int]] = []
    dsts: set[int] = set()
    i = start
    while i < len(ops):
        op = ops[i]
        if isinstance(op, OffloadOp) and kind is OffloadOp:
            src, dst = op.device_block, op.host_slot
        elif isinstance(op, RestoreHostOp) and kind is RestoreHostOp:
            src, dst = op.host_slot, op.device_block
        else:
            break
        if dst in dsts:
            break  # the same destination twice: the later copy goes in the next batch
        pairs.append((src, dst))
        dsts.add(dst)
        i += 1
    return i, pairs


def build_kv_tiers(
    *,
    device_cache: PagedKVCache,
    model_path: str | Path,
    host_bytes: int,
    disk_dir: str | None,
    disk_bytes: int,
) -> tuple[TierIndex, KVTierStore]:
    """The index and store for ``EngineConfig(kv_offload_*)``: budgets over one block's bytes,
    rounded down (a budget is never exceeded); the disk scanned (blocking: run it in a thread)."""
    payload = block_bytes(device_cache, 0)
    num_host = host_bytes // len(payload)
    disk = None
    disk_entries: list[BlockHash] = []
    budget = 0
    if disk_dir is not None:
        shape = (device_cache.num_layers, device_cache.num_kv_heads, device_cache.head_dim)
        identity = model_identity(
            model_path, device_cache.dtype, device_cache.block_size, shape, device_cache.layout
        )
        disk = DiskTier(disk_dir, identity, len(payload))
        budget = disk_bytes // disk.entry_bytes
        disk_entries = disk.scan(budget)
    return TierIndex(num_host, budget, disk_entries), KVTierStore(device_cache, num_host, disk)


__all__ = [
    "DiskTier",
    "KVTierError",
    "KVTierStore",
    "block_bytes",
    "build_kv_tiers",
    "load_block",
    "model_identity",
]
