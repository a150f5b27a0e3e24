"""``TritonAttentionBackend``: the model runner's attention on the Triton kernels, and a factory.

The backend reads and writes the runner's ``PagedKVCache`` in place through logical views (see
``paged_attention``), so copy-on-write and swap are unchanged. Per step it builds one tile plan
(keyed on the metadata object, reused by every layer), then per layer launches
``reshape_and_cache`` and ``paged_attention``.

``make_attention_backend(device, name)`` picks ``"triton"`` on CUDA and ``"torch"`` elsewhere;
a name overrides it. ``"triton"`` off CUDA needs the interpreter (``TRITON_INTERPRET=1`` set
before this package is imported).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import ClassVar, Literal

import torch

from asyncpaged.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.kv_cache import KVLayout, PagedKVCache

from ._util import is_interpreted, max_shared_mem
from .cache_ops import copy_blocks, reshape_and_cache
from .paged_attention import (
    TilePlan,
    _paged_attention_kernel,
    attention_config,
    paged_attention,
    plan_tiles,
)

BackendName = Literal["torch", "triton"]
KV_LAYOUT_ENV = "ASYNCPAGED_TRITON_KV_LAYOUT"


def logical_cache_views(
    kv_cache: PagedKVCache, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of the cache as logical ``[num_blocks, block_size, Hkv, D]`` views (the "nhd"
    layout's own tensors; the runner layout's permuted)."""
    key, value = kv_cache.layer(layer_idx)
    if kv_cache.layout == "nhd":
        return key, value
    num_blocks, kv_heads, block_size, head_dim = value.shape
    assert key.shape == (num_blocks, kv_heads, head_dim, block_size), (
        f"unexpected cache layout: K {tuple(key.shape)}, V {tuple(value.shape)}"
    )
    return key.permute(0, 3, 1, 2), value.permute(0, 2, 1, 3)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the Triton kernels (CUDA, or CPU under the interpreter).

    ``num_splits`` None lets the split-K heuristic decide per launch; an int forces it (tests).
    """

    # The forward reads device tensors, and from the host only the query layout and the
    # longest context (for the split-K count), which a CUDA graph's bucket fixes.
    graph_safe: ClassVar[bool] = True
    # K like V, head_dim contiguous: read as vectors (K transposed per block takes scalar
    # gathers). ASYNCPAGED_TRITON_KV_LAYOUT=runner gives it the CPU's layout (the A/B switch).
    kv_layout: KVLayout = "nhd"

    def __init__(self, *, num_splits: int | None = None) -> None:
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits must be a power of 2 >= 1, got {num_splits}.")
        self.num_splits = num_splits
        layout = os.environ.get(KV_LAYOUT_ENV, "nhd")
        if layout not in ("nhd", "runner"):
            raise ValueError(f"{KV_LAYOUT_ENV} must be 'nhd' or 'runner', got {layout!r}.")
        self.kv_layout = "runner" if layout == "runner" else "nhd"
        self._plan_metadata: AttentionMetadata | None = None  # kept alive: identity is the key
        self._plans: dict[int, TilePlan] = {}
        # CUDA graphs' metadata, kept with their plans (a graph replays the plans' tensors)
        self._pinned: dict[int, tuple[AttentionMetadata, dict[int, TilePlan]]] = {}

    def pin_metadata(self, metadata: AttentionMetadata) -> None:
        self._pinned.setdefault(id(metadata), (metadata, {}))

    def _plan(self, md: AttentionMetadata, query_lens: list[int], block_q: int) -> TilePlan:
        pinned = self._pinned.get(id(md))
        if pinned is not None:
            plans = pinned[1]
        else:
            if md is not self._plan_metadata:
                self._plan_metadata, self._plans = md, {}
            plans = self._plans
        if block_q not in plans:
            plans[block_q] = plan_tiles(query_lens, block_q, md.query_start_loc.device)
        return plans[block_q]

    def copy_blocks(self, kv_cache: PagedKVCache, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write with the all-layer Triton kernel (one launch); a quantized cache's
        scales too (torch copies: the kernel moves K and V only)."""
        copy_blocks(kv_cache.key, kv_cache.value, pairs)
        if kv_cache.key_scale is not None and kv_cache.value_scale is not None and pairs:
            src = torch.tensor([s for s, _ in pairs], device=kv_cache.key.device)
            dst = torch.tensor([d for _, d in pairs], device=kv_cache.key.device)
            for scales in (kv_cache.key_scale, kv_cache.value_scale):
                scales[:, dst] = scales[:, src]

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        assert not kv_cache.is_quantized, (
            f"the Triton kernels do not read a {kv_cache.dtype} (quantized) cache yet"
        )
        key_cache, value_cache = logical_cache_views(kv_cache, layer_idx)
        if key.stride(-1) != 1:
            key = key.contiguous()
        if value.stride(-1) != 1:
            value = value.contiguous()
        if query.stride(-1) != 1:
            query = query.contiguous()
        reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        starts = metadata.query_start_loc_host
        query_lens = [b - a for a, b in itertools.pairwise(starts)]
        cfg = attention_config(
            max(query_lens, default=0),
            query.shape[1] // key.shape[1],
            head_dim=query.shape[2],
            elem_bytes=key_cache.element_size(),
            shared_mem=max_shared_mem(query.device),
        )
        return paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables=metadata.block_tables,
            query_start_loc=metadata.query_start_loc,
            context_lens=metadata.context_lens,
            query_lens=query_lens,
            max_context_len=max(metadata.context_lens_host, default=0),
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            num_splits=self.num_splits,
            plan=self._plan(metadata, query_lens, cfg.block_q),
            config=cfg,
        )


def make_attention_backend(
    device: torch.device | str, name: BackendName | None = None
) -> AttentionBackend:
    """The attention backend for ``device``: ``name`` if given, else Triton on CUDA, torch else."""
    device = torch.device(device)
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda" and not is_interpreted(_paged_attention_kernel):
            raise ValueError(
                f"attention backend 'triton' needs a CUDA device, got {device.type!r} "
                "(or TRITON_INTERPRET=1 set before asyncpaged.kernels is imported)."
            )
        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be 'torch' or 'triton', got {name!r}.")
