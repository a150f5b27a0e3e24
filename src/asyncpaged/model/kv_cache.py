"""The paged KV cache: per-layer K and V blocks, owned by the model runner.

Layout (CPU, torch path), one tensor for K and one for V covering all layers::

    key:   [num_layers, num_blocks, num_kv_heads, head_dim, block_size]   K transposed per block
    value: [num_layers, num_blocks, num_kv_heads, block_size, head_dim]

    key[layer, block]            value[layer, block]
    ┌ kv head 0 ──────────────┐  ┌ kv head 0 ─────────────┐
    │ d0: t0 t1 ... t15       │  │ t0:  d0 d1 ... d(D-1)  │
    │ d1: t0 t1 ... t15       │  │ t1:  d0 d1 ... d(D-1)  │
    │ ...                     │  │ ...                    │
    └─────────────────────────┘  └────────────────────────┘

Why this layout: the native CPU decode kernel (``kernels/cpu_attention.py``) reads it with a score
loop of block_size-wide FMAs and no horizontal sums, faster than every torch attention path,
contiguous ones included; an NHD layout was 1.1-1.6x slower in that kernel. The kernel reads the
cache the runner owns, with no re-layout. The torch path in
``attention.py`` pays one permute while gathering (it copies the gathered blocks anyway). Keeping
all layers in one tensor makes copy-on-write and swap one indexed copy per K/V for every layer.

The "nhd" layout (vLLM's; ``PagedKVCache(layout="nhd")``, which the runner takes for the Triton
backend, ``AttentionBackend.kv_layout``) puts K like V, position-major within a block::

    key, value: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]

The Triton kernels read either layout through strides; on GPUs K transposed per block is read
with scalar gathers, and "nhd" made paged decode 1.2-1.4x faster at batch 4-256 on an H100 and
1.2-1.7x at batch >= 64 on an H200 (``asyncpaged.kernels.benchmark``; docs/benchmarks.md
"Attention on CUDA"). The CPU and torch paths read the runner layout only.

Quantized caches (``dtype`` int8, float8_e4m3fn or float8_e5m2; ``kv_quant``) hold codes in
``key`` / ``value`` with the layout above, and beside them a scale per (token, KV head) for K and
for V, in either layout::

    key_scale, value_scale: [num_layers, num_blocks, num_kv_heads, block_size]   bfloat16

A write quantizes each new row on its own scale, so an append never rescales what is already
written; readers dequantize (``codes * scale``). A block is its codes and its scales: copy-on-write,
swap and the KV tiers move both (``tensors``).

Slots: the slot of a token is ``block * block_size + offset``; slot ``-1`` means "do not write".
Host (swap, KV tier) caches use the device cache's layout, so swap is a per-block copy.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from asyncpaged.model.kv_quant import KV_SCALE_DTYPE, fill_code, is_quantized, quantize

#: How a block's K and V lie in memory (see the module docstring).
KVLayout = Literal["runner", "nhd"]


class PagedKVCache:
    """K/V blocks of every layer.

    Invariants: ``key`` and ``value`` have the shapes the module docstring gives for ``layout``;
    a block id indexes the same block in both and in every layer (and in ``key_scale`` /
    ``value_scale``, which a quantized cache has and any other lacks: None).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        fill_value: float | None = None,
        pin_memory: bool = False,
        layout: KVLayout = "runner",
    ) -> None:
        """Allocate the cache; ``fill_value`` (e.g. NaN in tests) poisons unused memory;
        ``pin_memory`` page-locks a host cache that swaps with a CUDA one (async copies)."""
        if layout not in ("runner", "nhd"):
            raise ValueError(f"layout must be 'runner' or 'nhd', got {layout!r}.")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layout: KVLayout = layout
        if layout == "nhd":
            key_shape = value_shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        else:
            key_shape = (num_layers, num_blocks, num_kv_heads, head_dim, block_size)
            value_shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        fill = 0.0 if fill_value is None else fill_value
        on = torch.device(device)
        code_fill = fill_code(dtype, fill) if is_quantized(dtype) else fill
        self.key = _allocate(key_shape, code_fill, dtype, on, pin_memory)
        self.value = _allocate(value_shape, code_fill, dtype, on, pin_memory)
        self.key_scale: torch.Tensor | None = None
        self.value_scale: torch.Tensor | None = None
        if is_quantized(dtype):
            scale_shape = (num_layers, num_blocks, num_kv_heads, block_size)
            self.key_scale = _allocate(scale_shape, fill, KV_SCALE_DTYPE, on, pin_memory)
            self.value_scale = _allocate(scale_shape, fill, KV_SCALE_DTYPE, on, pin_memory)

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def is_quantized(self) -> bool:
        """Whether the cache holds codes with scales (int8, fp8)."""
        return self.key_scale is not None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every all-layer tensor a block lives in (``[num_layers, num_blocks, ...]``): K and V,
        then K's and V's scales in a quantized cache. Moving a block moves it in each."""
        if self.key_scale is None or self.value_scale is None:
            return (self.key, self.value)
        return (self.key, self.value, self.key_scale, self.value_scale)

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K's and V's scales of one layer, [num_blocks, kv_heads, block_size] each; None
        unless the cache is quantized."""
        if self.key_scale is None or self.value_scale is None:
            return None
        return self.key_scale[layer_idx], self.value_scale[layer_idx]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer: K [num_blocks, kv_heads, D, bs], V [num_blocks, kv_heads, bs, D]
        ("runner"), or both [num_blocks, bs, kv_heads, D] ("nhd")."""
        return self.key[layer_idx], self.value[layer_idx]

    def write(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new rows: key/value [T, kv_heads, D] into slots [T] (int64; -1 skips the row)."""
        self.write_targets(layer_idx, key, value, SlotTargets.of(slot_mapping, self.block_size))

    def write_targets(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, targets: SlotTargets
    ) -> None:
        """``write`` with the slots already split into blocks and offsets (once per step)."""
        if targets.rows is not None:
            key, value = key[targets.rows], value[targets.rows]
        blocks, offsets = targets.blocks, targets.offsets
        key_cache, value_cache = self.layer(layer_idx)
        scales = self.layer_scales(layer_idx)
        if scales is not None:
            key, key_scale = quantize(key, self.dtype)
            value, value_scale = quantize(value, self.dtype)
            # [T, kv_heads] rows of the [num_blocks, kv_heads, block_size] scales
            scales[0][blocks, :, offsets] = key_scale
            scales[1][blocks, :, offsets] = value_scale
        if self.layout == "nhd":
            key_cache[blocks, offsets] = key.to(key_cache.dtype)
            value_cache[blocks, offsets] = value.to(value_cache.dtype)
            return
        # Advanced indices on dims 0 and 3 (2) around a slice: the indexed view is [T, kv_heads, D].
        key_cache[blocks, :, :, offsets] = key.to(key_cache.dtype)
        value_cache[blocks, :, offsets, :] = value.to(value_cache.dtype)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: for each ``(src, dst)`` copy block src onto dst in every layer.

        All sources are read before any destination is written; destinations must be distinct.
        """
        if not pairs:
            return
        src, dst = _pair_indices(pairs, self.key.device)
        for tensor in self.tensors:
            tensor[:, dst] = tensor[:, src]


@dataclass(frozen=True, slots=True)
class SlotTargets:
    """Where a step's new K/V rows go: rows ``rows`` (None = all) into ``(blocks, offsets)``.

    Layer-independent, so a step computes it once (``AttentionMetadata.slot_targets``).
    """

    rows: torch.Tensor | None  # [R] int64 rows with a slot (slot -1 rows are skipped)
    blocks: torch.Tensor  # [R] int64
    offsets: torch.Tensor  # [R] int64

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, block_size: int) -> SlotTargets:
        keep = slot_mapping >= 0
        rows = None
        if not bool(keep.all()):
            rows = torch.nonzero(keep).flatten()
            slot_mapping = slot_mapping[rows]
        return cls(rows, slot_mapping // block_size, slot_mapping % block_size)


HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14


def _allocate(
    shape: tuple[int, ...], fill: float, dtype: torch.dtype, device: torch.device, pin: bool
) -> torch.Tensor:
    """A filled cache tensor; on CPU its pages are advised huge before the fill touches them.

    The decode kernel walks blocks scattered over the whole cache, so 4 KiB pages cost a TLB
    miss per block; 2 MiB pages measured 10-15% faster there (Linux with transparent huge pages
    in "madvise" or "always" mode; elsewhere the advice is skipped).
    """
    if device.type != "cpu" or pin:
        return torch.full(shape, fill, dtype=dtype, device=device, pin_memory=pin)
    tensor = torch.empty(shape, dtype=dtype)
    _advise_huge_pages(tensor)
    return tensor.fill_(fill)


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):  # no libc symbol: keep normal pages
        return


def _pair_indices(
    pairs: Sequence[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    dsts = [d for _, d in pairs]
    assert len(set(dsts)) == len(dsts), f"duplicate destination blocks in {pairs}"
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor(dsts, dtype=torch.int64, device=device)
    return src, dst


def _check_compatible(a: PagedKVCache, b: PagedKVCache) -> None:
    same_shape = a.key.shape[0] == b.key.shape[0] and a.key.shape[2:] == b.key.shape[2:]
    same_layout = same_shape and a.layout == b.layout
    assert same_layout, (
        f"caches differ in layout: {a.layout} {tuple(a.key.shape)} vs {b.layout} "
        f"{tuple(b.key.shape)}"
    )
    assert a.dtype == b.dtype, f"caches differ in dtype: {a.dtype} vs {b.dtype}"
    assert a.is_quantized == b.is_quantized, "one cache has scales, the other none"


def swap_blocks(
    src: PagedKVCache,
    dst: PagedKVCache,
    pairs: Sequence[tuple[int, int]],
    stream: torch.cuda.Stream | None = None,
    after: torch.cuda.Event | None = None,
) -> None:
    """Copy block ``s`` of ``src`` onto block ``d`` of ``dst`` for each (s, d), in every layer.

    Returns when the copy has landed. With a CUDA ``stream`` (a swap between a CUDA cache and a
    pinned host cache) the transfer runs on that side stream, non-blocking, so the forward on the
    default stream goes on meanwhile; the blocks it moves belong to no scheduled sequence. The
    step that last wrote them has returned to the host but may still run on the device (a step
    that samples nothing never synchronizes): the side stream first waits for ``after``, the
    event the runner records at the end of each step's work.
    """
    _check_compatible(src, dst)
    if not pairs:
        return
    if stream is None:
        src_idx, dst_idx = _pair_indices(pairs, src.key.device)
        dst_idx = dst_idx.to(dst.key.device)
        for s_t, d_t in zip(src.tensors, dst.tensors, strict=True):
            d_t[:, dst_idx] = s_t[:, src_idx].to(d_t.device)
        return
    landed: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        src_idx, dst_idx = _pair_indices(pairs, src.key.device)  # on the side stream
        dst_idx = dst_idx.to(dst.key.device)
        for s_t, d_t in zip(src.tensors, dst.tensors, strict=True):
            block = s_t[:, src_idx]  # gathered on the source's device
            if d_t.is_cuda:
                d_t[:, dst_idx] = block.pin_memory().to(d_t.device, non_blocking=True)
            else:
                landed.append((d_t, block.to("cpu", non_blocking=True)))
    stream.synchronize()
    for d_t, block in landed:  # device -> host: only readable once the stream is done
        d_t[:, dst_idx] = block


def swap_out(
    device_cache: PagedKVCache,
    host_cache: PagedKVCache,
    pairs: Sequence[tuple[int, int]],
    stream: torch.cuda.Stream | None = None,
    after: torch.cuda.Event | None = None,
) -> None:
    """Copy (device block, host block) pairs from the device cache to the host cache."""
    swap_blocks(device_cache, host_cache, pairs, stream, after)


def swap_in(
    device_cache: PagedKVCache,
    host_cache: PagedKVCache,
    pairs: Sequence[tuple[int, int]],
    stream: torch.cuda.Stream | None = None,
    after: torch.cuda.Event | None = None,
) -> None:
    """Copy (host block, device block) pairs from the host cache back to the device cache."""
    swap_blocks(host_cache, device_cache, pairs, stream, after)
