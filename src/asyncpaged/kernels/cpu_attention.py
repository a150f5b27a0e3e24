"""Paged attention on the CPU through the native kernels, and the backend that uses them.

* ``paged_decode_attention``: decode (``csrc/paged_decode.cpp``), checks its inputs and calls the
  library through ctypes;
* ``reference_paged_decode``: the same attention in float64 with plain torch (tests);
* ``CpuAttentionBackend``: ``TorchAttentionBackend`` with the K/V write, the decodes and the
  prefills on the native kernels (``cpu_ops.py``), but a bfloat16 model's whole prompts, which
  take torch's bf16 SDPA as transformers does; any call they cannot take stays on torch;
* ``make_cpu_attention_backend``: that backend when the library builds, else the torch one.

Decode: one query token per sequence, at position ``context_len - 1``; with a sliding window
``w`` it attends the last ``w`` positions (``attention.py``: key ``k`` is visible iff
``k > q_pos - w``). Scores are ``scale * q.k``, or ``softcap * tanh(scale * q.k / softcap)``
with a ``softcap`` (Gemma 2), before the mask and the softmax. Head dims 16, 32, 64, 80, 96, 128
and 256 (``cpu_ops.SUPPORTED_HEAD_DIMS``). The kernels accumulate in fp32 and read fp32 or bf16
caches, or int8 / fp8 (e4m3fn, e5m2) codes with their per-token bf16 scales (``key_scale`` /
``value_scale``, ``kv_quant``), decoded in registers. Nothing here imports Triton (the
package's ``__init__`` does, for the CUDA kernels).
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

import torch

from asyncpaged.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    _prefill_one,
    _write,
)
from asyncpaged.model.kv_cache import PagedKVCache

from .cpu_build import load_library
from .cpu_ops import (
    BLOCK_SIZE_MULTIPLE,
    CACHE_DTYPE_CODES,
    KV_DTYPE_CODES,
    SUPPORTED_HEAD_DIMS,
    gather_blocks_f64,
    launch_prefill,
    launch_write,
    library_or_raise,
    status_message,
)
from .cpu_ops import _ptr as _data_ptr
from .cpu_ops import check_inputs as _check_inputs
from .cpu_ops import rows_dense as _rows_dense

# "0" turns the native prefill and K/V write off (decodes stay native): an A/B switch for
# benchmarks of the engine, which builds its backend with the defaults.
NATIVE_PREFILL_ENV: Final = "ASYNCPAGED_CPU_NATIVE_PREFILL"


def is_available(target: str | None = None) -> bool:
    """Whether the kernel library builds and loads here (compiles it on first call)."""
    return load_library(target) is not None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    num_threads: int | None = None,
    target: str | None = None,
) -> torch.Tensor:
    """Decode attention of sequence ``i``'s query ``query[i]`` over its cached context.

    query [S, Hq, D] float32; key_cache [num_blocks, Hkv, D, bs], value_cache [num_blocks, Hkv,
    bs, D] (float32, bfloat16, or int8 / fp8 codes with bfloat16 ``key_scale`` / ``value_scale``
    [num_blocks, Hkv, bs]; contiguous); block_tables [S, max_blocks] int64 (padding never
    read); context_lens [S] int64 -> out [S, Hq, D] float32. ``softcap``: Gemma 2's logit
    softcapping (None: none). ``num_threads`` defaults to
    ``torch.get_num_threads()``; ``target`` picks a build (default: the best this CPU runs).
    A one-off ``DecodePlan``: to run the same tables over several layers, make the plan once.
    """
    plan = DecodePlan(
        query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window,
        softcap=softcap, target=target, key_scale=key_scale, value_scale=value_scale,
    )  # fmt: skip
    return plan.run(
        query, key_cache, value_cache, out,
        key_scale=key_scale, value_scale=value_scale, num_threads=num_threads,
    )  # fmt: skip


class DecodePlan:
    """One decode call's block tables, checked and copied once, run per layer.

    ``DecodePlan(query, key_cache, value_cache, block_tables, context_lens, scale, ...)`` takes
    the same inputs as ``paged_decode_attention`` (``query`` and the caches fix the shapes and
    dtype every run must have); ``seq_indices`` / ``query_rows`` pick the sequences and rows
    as for the backend's mixed steps; a quantized cache's ``key_scale`` / ``value_scale`` are
    checked with it and passed to every run. ``run(query, key_cache, value_cache, out)`` then
    checks only those tensors: the tables, lengths and indices were checked and copied into the
    plan, so changing the tensors they came from afterwards changes nothing. This is what the
    backend does once per step: a layer's call costs ~4 us of Python and ctypes, against ~16 for
    the one-call function (which makes a one-off plan).

    Invariants: the native plan holds copies of every index it follows, each checked against
    the cache's ``num_blocks`` and the query's row count; a run accepts only tensors of the
    plan's shapes and dtype, on the CPU, so it never reads outside them; the native plan is
    freed when this object is collected (``__del__``).
    """

    def __init__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        seq_indices: torch.Tensor | None = None,
        query_rows: torch.Tensor | None = None,
        target: str | None = None,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
    ) -> None:
        _check_inputs(
            query, key_cache, value_cache, block_tables, context_lens, sliding_window, softcap,
            key_scale, value_scale,
        )  # fmt: skip
        if context_lens.shape[0] != block_tables.shape[0]:
            raise ValueError(
                f"context_lens needs one entry per block table row ({block_tables.shape[0]}), "
                f"got {tuple(context_lens.shape)}."
            )
        num_items = query.shape[0] if seq_indices is None else seq_indices.numel()
        if seq_indices is None and block_tables.shape[0] != num_items:
            raise ValueError(
                f"block_tables needs {num_items} rows (one per query) without seq_indices, got "
                f"{tuple(block_tables.shape)}."
            )
        for name, index in (("seq_indices", seq_indices), ("query_rows", query_rows)):
            if index is not None and (
                index.dtype != torch.int64 or index.dim() != 1 or index.numel() != num_items
            ):
                raise ValueError(f"{name} must be int64 [{num_items}], got {index.dtype} "
                                 f"{tuple(index.shape)}.")  # fmt: skip
        lib = library_or_raise(target)
        context_lens = context_lens.contiguous()
        seq_indices = None if seq_indices is None else seq_indices.contiguous()
        query_rows = None if query_rows is None else query_rows.contiguous()
        num_blocks, kv_heads, head_dim, block_size = key_cache.shape
        status = ctypes.c_int32(0)
        handle = lib.asyncpaged_decode_plan_create(
            query.shape[0], CACHE_DTYPE_CODES[key_cache.dtype],
            num_blocks, kv_heads, head_dim, block_size,
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
            block_tables.shape[0],
            context_lens.data_ptr(),
            None if seq_indices is None else seq_indices.data_ptr(),
            None if query_rows is None else query_rows.data_ptr(),
            num_items, query.shape[1], scale, sliding_window or 0, softcap or 0.0,
            ctypes.byref(status),
        )  # fmt: skip
        if not handle:
            raise ValueError(
                f"paged decode attention refused its inputs: {status_message(status.value)}."
            )
        self._lib = lib
        self._handle: int = handle
        self._query_shape = query.shape
        self._key_shape, self._value_shape = key_cache.shape, value_cache.shape
        self._kv_dtype = key_cache.dtype
        self._scale_shape = None if key_scale is None else key_scale.shape

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)  # unset when __init__ raised
        if handle:
            self._handle = 0
            self._lib.asyncpaged_decode_plan_free(handle)

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        key_scale: torch.Tensor | None = None,
        value_scale: torch.Tensor | None = None,
        num_threads: int | None = None,
    ) -> torch.Tensor:
        """The attention of this plan's items for one layer: ``out`` [S, Hq, D] float32
        (``key_scale`` / ``value_scale``: the layer's scales, for a quantized cache only)."""
        if not (
            query.shape == self._query_shape
            and query.dtype == torch.float32
            and query.is_cpu
            and _rows_dense(query)
            and key_cache.shape == self._key_shape
            and value_cache.shape == self._value_shape
            and key_cache.dtype == self._kv_dtype
            and value_cache.dtype == self._kv_dtype
            and key_cache.is_cpu
            and value_cache.is_cpu
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and _scales_fit(key_scale, value_scale, self._scale_shape)
        ):
            raise ValueError(
                f"the plan takes float32 query {tuple(self._query_shape)} with contiguous rows "
                f"and {self._kv_dtype} caches {tuple(self._key_shape)} / "
                f"{tuple(self._value_shape)} on the CPU (with contiguous bfloat16 scales "
                f"{self._scale_shape} where quantized), got {query.dtype} "
                f"{tuple(query.shape)} and {key_cache.dtype} {tuple(key_cache.shape)} / "
                f"{value_cache.dtype} {tuple(value_cache.shape)}."
            )
        if out is None:
            out = torch.empty(self._query_shape, dtype=torch.float32)
        elif not (out.shape == self._query_shape and out.dtype == torch.float32 and out.is_cpu
                  and _rows_dense(out)):  # fmt: skip
            raise ValueError(
                f"out must be float32 of shape {tuple(self._query_shape)} with contiguous "
                f"[Hq, D] rows, got {out.dtype} {tuple(out.shape)} strides {out.stride()}."
            )
        status = self._lib.asyncpaged_decode_plan_run(
            self._handle, out.data_ptr(), out.stride(0), query.data_ptr(), query.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), _data_ptr(key_scale),
            _data_ptr(value_scale), torch.get_num_threads() if num_threads is None else num_threads,
        )  # fmt: skip
        if status != 0:  # the plan's checks leave none, but a silent no-op would return garbage
            raise ValueError(
                f"paged decode attention refused its inputs: {status_message(status)}."
            )
        return out


def reference_paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in float64 (gather each sequence's blocks, softmax): [S, Hq, D]; a
    quantized cache's blocks are dequantized as they are gathered."""
    num_seqs, num_heads, head_dim = query.shape
    _, kv_heads, _, block_size = key_cache.shape
    group = num_heads // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for i in range(num_seqs):
        ctx = int(context_lens[i])
        start = 0 if sliding_window is None else max(0, ctx - sliding_window)
        blocks = block_tables[i, : -(-ctx // block_size)]
        keys, values = gather_blocks_f64(key_cache, value_cache, blocks, key_scale, value_scale)
        keys = keys.permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)
        values = values.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)
        keys, values = keys[:, start:ctx], values[:, start:ctx]  # [Hkv, n, D]
        q = query[i].double().view(kv_heads, group, head_dim)
        scores = q @ keys.transpose(1, 2) * scale  # [Hkv, G, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores, dim=-1)
        out[i] = (probs @ values).reshape(num_heads, head_dim)
    return out


class CpuAttentionBackend(TorchAttentionBackend):
    """``TorchAttentionBackend`` with the K/V write, decodes and prefills on the native kernels.

    The write stores the bits the parent's write stores (bf16 rounding included); decodes go to
    the decode kernel, prefills (full, chunked, prefix hits) to the prefill kernel, each once per
    layer for the whole step. In a bfloat16 model a whole prompt (its rows are its whole context:
    no cached prefix, no earlier chunk; no softcap, no window shorter than it) goes to torch's
    causal SDPA in bf16 instead, on the step's own K/V rows: the call transformers makes, 2-4x
    faster than the kernel's fp32 math (which reads the cache) and per sequence, so batch-free.
    With ``sdpa_bf16_decode`` (the runner sets it from the CPU plan's ``native_bf16_decode``
    lever, which an engine leaves off: SDPA on) its decodes (no softcap, no sliding window) take
    the same SDPA per sequence over the context gathered from the cache: transformers' decode
    call, so its bits, where the kernel's fp32 math sums in another order; the kernel is 2-4x
    faster per step on small models.
    A quantized cache (int8, fp8) takes the kernels for every call, whole bf16 prompts and
    decodes included (SDPA would see values the cache does not hold): the write quantizes as
    ``kv_quant`` does, bit for bit, and attention reads the codes with their scales.
    A call the kernels cannot take (library unavailable, non-CPU tensors, a cache dtype other
    than float32/bfloat16/int8/fp8, an unsupported head dim or block size) goes to the parent
    whole; K/V
    in another dtype (float16) are written by the parent's write. ``native_prefill=False`` keeps
    the parent's write and per-sequence prefill (A/B runs; default: on unless
    ``ASYNCPAGED_CPU_NATIVE_PREFILL=0``). Per step the decode rows and prefill sequences are
    turned into index tensors and a ``DecodePlan`` once (keyed on the metadata object, reused by
    every layer with the same shapes, scale, window and softcap).
    """

    def __init__(
        self,
        decode_group_size: int = 8,
        *,
        target: str | None = None,
        native_prefill: bool | None = None,
        sdpa_bf16_decode: bool = False,
    ) -> None:
        super().__init__(decode_group_size)
        self.sdpa_bf16_decode = sdpa_bf16_decode
        self._target = target
        self._library = load_library(target)
        # This step's decode plans, by (scale, window, softcap, query shape, cache shape, dtype).
        self._decode_plans: dict[tuple[object, ...], DecodePlan] = {}
        if native_prefill is None:
            native_prefill = os.environ.get(NATIVE_PREFILL_ENV, "1").strip() != "0"
        self.native_prefill = native_prefill
        self._rows_metadata: AttentionMetadata | None = None  # kept alive: identity is the key
        self._rows = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        self._prefill_seqs = torch.empty(0, dtype=torch.int64)
        # This step's (whole prompts for SDPA, the rest for the kernel), by sliding window.
        self._splits: dict[int | None, tuple[tuple[int, ...], torch.Tensor]] = {}
        # This step's decodes for SDPA: (query row, context length, block ids), by block size.
        self._decode_contexts: dict[int, list[tuple[int, int, torch.Tensor]]] = {}

    @property
    def is_native(self) -> bool:
        """Whether the kernel library loaded (otherwise every call takes the torch path)."""
        return self._library is not None

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
        lib = self._library
        if lib is None or not _kernel_fits(query, kv_cache):
            return super().forward(
                layer_idx, query, key, value, kv_cache, metadata,
                scale=scale, sliding_window=sliding_window, softcap=softcap,
            )  # fmt: skip
        key_cache, value_cache = kv_cache.layer(layer_idx)
        scales = kv_cache.layer_scales(layer_idx)
        key_scale, value_scale = (None, None) if scales is None else scales
        if self.native_prefill and key.dtype in KV_DTYPE_CODES and value.dtype == key.dtype:
            k = key if _rows_dense(key) else key.contiguous()
            v = value if _rows_dense(value) else value.contiguous()
            launch_write(lib, k, v, key_cache, value_cache, metadata.slot_mapping, None,
                         key_scale, value_scale)  # fmt: skip
        else:
            _write(kv_cache, layer_idx, key, value, metadata)
        seq_indices, query_rows, prefill_seqs = self._step_rows(metadata)
        whole: tuple[int, ...] = ()
        rest = prefill_seqs  # the prefills the kernel takes
        # bf16 SDPA reads the step's unrounded rows (prompts) or the cache's values (decodes):
        # never over a quantized cache, which the kernels read
        bf16 = query.dtype == key.dtype == value.dtype == torch.bfloat16 and scales is None
        if metadata.prefill_indices and self.native_prefill and softcap is None and bf16:
            whole, rest = self._prefill_split(metadata, sliding_window)
        # The kernels read dense fp32 query rows; a step of whole bf16 prompts needs none.
        if metadata.decode_indices or (self.native_prefill and rest.numel()):
            q = query if query.dtype == torch.float32 and _rows_dense(query) else query.float()
            q = q if _rows_dense(q) else q.contiguous()
        out = torch.empty(query.shape, dtype=torch.float32)  # [T, Hq, D]
        if (
            metadata.decode_indices
            and bf16
            and self.sdpa_bf16_decode
            and softcap is None
            and (sliding_window is None)
        ):
            for row, ctx, blocks in self._decodes_for_sdpa(metadata, key_cache.shape[-1]):
                _sdpa_decode(row, ctx, blocks, out, query, key_cache, value_cache, scale)
        elif metadata.decode_indices:
            plan_key = (scale, sliding_window, softcap, q.shape, key_cache.shape, key_cache.dtype)
            plan = self._decode_plans.get(plan_key)
            if plan is None:  # the first layer of the step (or of its shapes)
                plan = DecodePlan(
                    q, key_cache, value_cache, metadata.block_tables, metadata.context_lens,
                    scale, sliding_window, softcap=softcap, seq_indices=seq_indices,
                    query_rows=query_rows, target=self._target, key_scale=key_scale,
                    value_scale=value_scale,
                )  # fmt: skip
                self._decode_plans[plan_key] = plan
            plan.run(q, key_cache, value_cache, out, key_scale=key_scale, value_scale=value_scale)
        if metadata.prefill_indices and self.native_prefill:
            for i in whole:
                _sdpa_prompt(i, out, query, key, value, metadata, scale)
            if rest.numel():
                launch_prefill(
                    lib, out, q, key_cache, value_cache, metadata.block_tables,
                    metadata.query_start_loc, metadata.context_lens, rest, scale,
                    sliding_window, None, softcap=softcap, key_scale=key_scale,
                    value_scale=value_scale,
                )  # fmt: skip
        elif metadata.prefill_indices:
            for i in metadata.prefill_indices:
                _prefill_one(
                    i, out, query, key_cache, value_cache, metadata, scale, sliding_window,
                    softcap, scales,
                )  # fmt: skip
        return out if query.dtype == torch.float32 else out.to(query.dtype)

    def _step_rows(self, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence index, query row) of each decode and the prefill sequences, as int64."""
        if md is not self._rows_metadata:
            seqs = md.decode_indices
            rows = [md.query_start_loc_host[i] for i in seqs]
            self._rows = (
                torch.tensor(seqs, dtype=torch.int64),
                torch.tensor(rows, dtype=torch.int64),
            )
            self._prefill_seqs = torch.tensor(md.prefill_indices, dtype=torch.int64)
            self._decode_plans.clear()
            self._splits.clear()
            self._decode_contexts.clear()
            self._rows_metadata = md
        return (*self._rows, self._prefill_seqs)

    def _decodes_for_sdpa(
        self, md: AttentionMetadata, block_size: int
    ) -> list[tuple[int, int, torch.Tensor]]:
        """This step's decodes as (query row, context length, its blocks), once per step for
        every layer; after ``_step_rows`` for ``md``."""
        found = self._decode_contexts.get(block_size)
        if found is None:
            starts, ctxs = md.query_start_loc_host, md.context_lens_host
            found = self._decode_contexts[block_size] = [
                (starts[i], ctxs[i], md.block_tables[i, : -(-ctxs[i] // block_size)])
                for i in md.decode_indices
            ]
        return found

    def _prefill_split(
        self, md: AttentionMetadata, window: int | None
    ) -> tuple[tuple[int, ...], torch.Tensor]:
        """This step's prefill sequences split into whole prompts (SDPA) and the rest (the
        kernel); after ``_step_rows`` for ``md``."""
        split = self._splits.get(window)
        if split is None:
            starts, ctx = md.query_start_loc_host, md.context_lens_host
            whole = tuple(
                i for i in md.prefill_indices
                if starts[i + 1] - starts[i] == ctx[i] and (window is None or window >= ctx[i])
            )  # fmt: skip
            rest = [i for i in md.prefill_indices if i not in whole]
            split = self._splits[window] = (whole, torch.tensor(rest, dtype=torch.int64))
        return split


def _sdpa_prompt(
    i: int,
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> None:
    """Sequence ``i``'s whole-prompt causal attention through torch's SDPA in the rows' dtype,
    into its rows of ``out``: query [T, Hq, D], key / value [T, Hkv, D], the step's rows."""
    start, end = md.query_start_loc_host[i], md.query_start_loc_host[i + 1]
    q = query[start:end].transpose(0, 1)[None]  # [1, Hq, L, D]
    k, v = key[start:end].transpose(0, 1)[None], value[start:end].transpose(0, 1)[None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )  # [1, Hq, L, D]
    out[start:end] = o[0].transpose(0, 1)


def _sdpa_decode(
    row: int,
    ctx: int,
    blocks: torch.Tensor,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
) -> None:
    """The attention of the decode at query ``row`` through torch's SDPA in bf16 over its
    ``ctx`` tokens gathered from ``blocks`` of the cache, into its row of ``out``: the call
    transformers makes for a decode step (one query row, no mask), so the same bits. key_cache
    [blocks, Hkv, D, bs] (K transposed per block), value_cache [blocks, Hkv, bs, D]."""
    kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2]
    # [nb, Hkv, D, bs] -> [Hkv, nb, bs, D] -> [1, Hkv, ctx, D], contiguous as transformers'
    # cache is (SDPA takes another path, other bits, where D is not the dense dimension)
    k = key_cache[blocks].permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)[:, :ctx]
    v = value_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :ctx]
    k, v = k.contiguous()[None], v.contiguous()[None]
    q = query[row : row + 1].transpose(0, 1)[None]  # [1, Hq, 1, D]
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=q.shape[1] != kv_heads
    )  # [1, Hq, 1, D]
    out[row] = o[0, :, 0]


def _scales_fit(
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    shape: torch.Size | None,
) -> bool:
    """Whether a run's scales are what its plan was made for (``shape`` None: no scales)."""
    if shape is None:
        return key_scale is None and value_scale is None
    return all(
        t is not None and t.shape == shape and t.dtype == torch.bfloat16 and t.is_cpu
        and t.is_contiguous()
        for t in (key_scale, value_scale)
    )  # fmt: skip


def _kernel_fits(query: torch.Tensor, kv_cache: PagedKVCache) -> bool:
    """Whether the kernel takes this layer's call (else the torch path does)."""
    return (
        query.device.type == "cpu"
        and kv_cache.layout == "runner"
        and kv_cache.key.device.type == "cpu"
        and query.dim() == 3
        and query.is_floating_point()
        and kv_cache.dtype in CACHE_DTYPE_CODES
        and kv_cache.head_dim in SUPPORTED_HEAD_DIMS
        and query.shape[2] == kv_cache.head_dim
        and kv_cache.block_size % BLOCK_SIZE_MULTIPLE == 0
        and query.shape[1] % kv_cache.num_kv_heads == 0
    )


def make_cpu_attention_backend(decode_group_size: int = 8) -> AttentionBackend:
    """``CpuAttentionBackend`` when the kernel library builds here, else ``TorchAttentionBackend``
    (the build failure is logged once as ``cpu_kernel_unavailable``)."""
    backend = CpuAttentionBackend(decode_group_size)
    if backend.is_native:
        return backend
    return TorchAttentionBackend(decode_group_size)
