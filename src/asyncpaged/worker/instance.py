"""One loaded model with its KV caches: what the model runner and the draft model each hold.

A :class:`ModelInstance` is a checkpoint's weights on a device (on the CPU prepared for
oneDNN and the native kernels: packed linears, fused elementwise ops), its device paged KV
cache, its host (swap) cache of the same layout and dtype, and, once captured, the CUDA graphs
of its decode forward (``cuda_graphs``). ``forward`` replays a graph for a decode-only batch
that one holds, else runs the eager forward; ``swap_out`` / ``swap_in`` copy blocks between
the caches and ``copy_blocks`` within the device cache.

``ModelRunner`` holds the target's instance (and adds the LM-head screens, the sampler's
generator, the swap stream); ``DraftModel`` holds the draft's (its device cache with scratch
blocks past the target's block ids, its graphs reaching past ``max_model_len``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from asyncpaged.errors import InvalidRequestError
from asyncpaged.model.attention import AttentionBackend, AttentionMetadata
from asyncpaged.model.base import FUSED_DTYPES, SINGLE_SHARD, CausalLM, TensorShard
from asyncpaged.model.kv_cache import PagedKVCache, swap_in, swap_out
from asyncpaged.model.loader import load_model
from asyncpaged.model.packed_linear import pack_linears
from asyncpaged.model.quantized_linear import set_activations
from asyncpaged.worker.cuda_graphs import Capture, DecodeGraphs, capture_decode_graphs

__all__ = ["ModelInstance"]


class ModelInstance:
    """A model's weights, its device KV cache, its host (swap) KV cache and its decode graphs.

    Invariants: the device and host caches share layout and dtype; a block id names the same
    block in every layer; the caches hold ``model.num_kv_heads`` heads (a tensor-parallel
    shard's share); ``graphed`` says whether the last ``forward`` replayed a graph.
    """

    def __init__(
        self,
        checkpoint_path: str | Path,
        dtype: str | torch.dtype,
        device: torch.device,
        *,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        kv_cache_dtype: torch.dtype | None = None,
        attn_backend: AttentionBackend | None = None,
        kv_fill_value: float | None = None,
        packed_linears: bool = True,
        fused_elementwise: bool = True,
        shard: TensorShard = SINGLE_SHARD,
        quantized_activations: str = "float32",
    ) -> None:
        """Load ``shard`` of the checkpoint on ``device`` and allocate ``num_blocks`` device
        blocks and ``num_host_blocks`` host blocks of ``block_size`` tokens.

        ``kv_cache_dtype`` (None: the model's dtype) is the dtype K/V are stored in;
        ``kv_fill_value`` poisons the caches (tests: NaN). On the CPU, ``packed_linears``
        pre-packs the layers' weights for oneDNN (not the LM head's: its owner decides) and
        ``fused_elementwise`` gives the model native fused norm / RoPE / SiLU ops
        (``CausalLM.fused_ops``) when the kernel library builds here. ``attn_backend`` must be
        this instance's own (backends keep per-step plans). ``quantized_activations``: how
        quantized weights multiply (``quantized_linear.set_activations``)."""
        self.device = device
        self.model: CausalLM = load_model(checkpoint_path, dtype, device, shard)
        set_activations(self.model, quantized_activations)
        if attn_backend is not None:
            self.model.attn_backend = attn_backend
        self.dtype = self.model.lm_head_weight().dtype
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.block_size = block_size
        on_cpu = device.type == "cpu"
        if packed_linears and on_cpu:  # (float32 and bfloat16 weights: packed_linear)
            pack_linears(self.model, batch_hint=64, keep=(self.model.lm_head_weight(),))
        if fused_elementwise and on_cpu and self.dtype in FUSED_DTYPES:
            from asyncpaged.kernels.cpu_fused import fused_ops

            self.model.fused_ops = fused_ops()  # None (torch code) when it cannot be built
        try:
            self.kv_cache = self._make_cache(num_blocks, device, kv_fill_value)
        except torch.cuda.OutOfMemoryError as exc:  # the budget's estimate, or another process
            raise InvalidRequestError(
                f"a KV cache of {num_blocks} blocks does not fit on {device} beside the "
                "model: lower gpu_memory_utilization, or set kv_cache_bytes / num_device_blocks."
            ) from exc
        self.host_kv_cache = self._make_cache(num_host_blocks, torch.device("cpu"), kv_fill_value)
        self.graphs: DecodeGraphs | None = None  # ``capture_graphs``
        self.graphed = False  # the last forward replayed a graph

    def _make_cache(
        self, num_blocks: int, on: torch.device, fill_value: float | None
    ) -> PagedKVCache:
        """A cache of ``num_blocks`` blocks on ``on`` (pinned: a host cache that swaps with a
        CUDA one); the attention backend's layout, the host cache's too (swaps copy blocks)."""
        return PagedKVCache(
            num_layers=self.model.num_layers, num_blocks=num_blocks, block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
            dtype=self.kv_cache_dtype, device=on, fill_value=fill_value,
            pin_memory=self.device.type == "cuda" and on.type == "cpu",
            layout=self.model.attn_backend.kv_layout,
        )  # fmt: skip

    def capture_graphs(
        self,
        sizes: Sequence[int],
        max_model_len: int,
        capture: Capture | None = None,
        *,
        name: str = "model",
    ) -> tuple[int, ...]:
        """Capture the decode forward for these batch sizes, for block tables of up to
        ``max_model_len`` tokens (``cuda_graphs``); the sizes captured, () where graphs cannot
        run here (logged with the reason, about ``name``). ``capture`` replaces the CUDA
        capture (tests: an eager stand-in on the CPU)."""
        self.graphs = capture_decode_graphs(
            self.model, self.kv_cache, sizes=sizes, max_model_len=max_model_len,
            block_size=self.block_size, capture=capture, name=name,
        )  # fmt: skip
        return () if self.graphs is None else self.graphs.sizes

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [T, H]: a decode-only batch through its CUDA graph when one is
        captured for it, else the model's eager forward (K/V written into the device cache)."""
        graphs = self.graphs
        hidden = None if graphs is None else graphs.run(ids, positions, metadata)
        self.graphed = hidden is not None
        if hidden is None:
            hidden = self.model(ids, positions, metadata, self.kv_cache)
        return hidden

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy (source, destination) blocks within the device cache (copy-on-write)."""
        self.model.attn_backend.copy_blocks(self.kv_cache, pairs)

    def swap_out(
        self,
        pairs: tuple[tuple[int, int], ...],
        stream: torch.cuda.Stream | None = None,
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Copy (device block, host block) pairs to the host cache; on CUDA on ``stream``,
        once ``after`` (the end of the last step) has been reached."""
        swap_out(self.kv_cache, self.host_kv_cache, pairs, stream, after)

    def swap_in(
        self,
        pairs: tuple[tuple[int, int], ...],
        stream: torch.cuda.Stream | None = None,
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Copy (host block, device block) pairs back to the device cache (as ``swap_out``)."""
        swap_in(self.kv_cache, self.host_kv_cache, pairs, stream, after)
