"""Varlen paged attention in Triton: decode, prefill, chunked prefill and prefix hits in one kernel.

Inputs follow ``asyncpaged.model.attention``: a flat batch of ``T`` new query rows, sequence ``i``
owning rows ``query_start_loc[i]:query_start_loc[i+1]``; ``context_lens[i]`` tokens (cached prefix
plus the new ones) already in the cache. New row ``j`` of a sequence sits at position
``context_len - query_len + j`` and sees keys ``0..position`` (within the sliding window if any).
Scores are ``scale * q.k``, or ``softcap * tanh(scale * q.k / softcap)`` with a ``softcap``
(Gemma 2's attention logit softcapping), before the mask and the softmax. Any head dim works (the
head-dim tile is the next power of two, ``block_d_for``); tested at 64, 80 and 256.

Cache layout. The kernels read the cache through a *logical view* ``[num_blocks, block_size,
kv_heads, head_dim]`` with arbitrary strides, so one kernel serves every physical layout:

    runner layout (PagedKVCache(layout="runner"), the CPU kernels'; CoW and swap copy blocks):
        K block [kv_heads, head_dim, block_size]  ->  logical view key.permute(0, 3, 1, 2)
        V block [kv_heads, block_size, head_dim]  ->  logical view value.permute(0, 2, 1, 3)
    NHD (PagedKVCache(layout="nhd"), what the runner allocates for TritonAttentionBackend):
        K and V blocks [block_size, kv_heads, head_dim] -> the logical view as they are

Either way a block is one contiguous piece of memory per layer, so copy-on-write and swap stay
per-block copies. With head_dim contiguous (V in the runner layout, K and V in NHD) Triton
vectorizes the loads along head_dim; K transposed per block is read with scalar gathers, so
NHD decodes 1.2-1.4x faster at batch 4-256 on an H100 (``asyncpaged/kernels/benchmark.py``, run by
``scripts/gpu_check.sh``; docs/benchmarks.md "Attention on CUDA (Triton)").

Tiling. A program owns one *q tile* (``BLOCK_Q`` consecutive new tokens of one sequence, from a
host-built tile map) and one KV head. The ``G = Hq / Hkv`` query heads of that KV head are packed
into the rows of the tile (``BLOCK_M = BLOCK_Q * G`` rows; row ``r`` = token ``r // G``, head
``r % G``), so every K/V tile is loaded once per KV head and feeds all of its query heads. Keys are
walked in tiles of ``BLOCK_N`` positions (several pages; page numbers come from the block table per
position, int64), only up to the last position the tile's rows may see. Online softmax in base 2
(log2(e) folded into the score scale, or into the cap: ``softcap * log2(e) * tanh(scale / softcap
* q.k)``), fp32 accumulation; 16-bit inputs go through fp32 right after every load.

Split-K (flash decoding). With few programs and long contexts, a third grid axis cuts each tile's
key range into ``num_splits`` pieces; each writes an fp32 partial output normalized by its own sum
plus its log-sum-exp (base 2), and ``_merge_splits_kernel`` combines them (an empty split has
lse = -inf and weight 0).

Interpreter notes (``TRITON_INTERPRET=1``): bf16 ``tl.dot`` is wrong there, so bf16 dots run on
fp32 operands under the interpreter (``NATIVE_DOT``); fp16 dots run natively in both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._util import is_interpreted, max_shared_mem, target_num_programs

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]
    """tanh from exp2 (tl.math has no tanh in every Triton version, nor in the interpreter), as
    the CPU kernels do it (csrc/cpu_vec.h): (1 - e) / (1 + e) with e = exp(-2|x|) for |x| >= 0.3,
    where 1 - e cannot cancel, and the Taylor series to x^11 below; the sign put back."""
    a = tl.abs(x)
    e = tl.math.exp2(-2.8853900817779268 * a)  # exp(-2a): 2 log2(e) = 2.885...
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    poly = -1382.0 / 155925.0
    poly = poly * a2 + 62.0 / 2835.0
    poly = poly * a2 - 17.0 / 315.0
    poly = poly * a2 + 2.0 / 15.0
    poly = poly * a2 - 1.0 / 3.0
    t = tl.where(a < 0.3, a + a * (a2 * poly), big)
    return tl.where(x < 0.0, -t, t)


# Integers that change from step to step are not specialized (Triton compiles a variant per
# value that is 1 or a multiple of 16): the block-table row stride follows the longest sequence
# and the split strides the token count, so a live engine would otherwise recompile mid-run.
@triton.jit(do_not_specialize=["stride_os", "stride_ls", "stride_bts"])  # type: ignore[untyped-decorator]
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, Hq, D] (NUM_SPLITS == 1) or fp32 partials [S, T, Hq, D]
    lse_ptr,  # fp32 [S, T, Hq] (only with NUM_SPLITS > 1)
    q_ptr,  # [T, Hq, D]
    k_ptr,  # logical [num_blocks, block_size, Hkv, D]
    v_ptr,  # logical [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [S, max_blocks] int64
    query_start_loc_ptr,  # [S + 1] int64
    context_lens_ptr,  # [S] int64
    tile_seq_ptr,  # [num_tiles] int32
    tile_q_start_ptr,  # [num_tiles] int32, first new token of the tile, relative to its sequence
    qk_scale,  # softmax scale * log2(e); with HAS_SOFTCAP: scale / softcap
    softcap_log2,  # softcap * log2(e), used only with HAS_SOFTCAP
    window,  # sliding window (keys > position - window), used only with HAS_WINDOW
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_ls,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_bts,
    NUM_HEADS: tl.constexpr,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    q_tile_start = tl.load(tile_q_start_ptr + tile).to(tl.int64)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    ctx = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + offs_m // G  # [M] new-token index inside the sequence
    head = kv_head * G + offs_m % G  # [M] query head
    row_valid = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx  # [M] absolute position of the row's token
    token = q_begin + q_idx  # [M] int64 row in the flat batch
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    if NATIVE_DOT:
        q = q.to(q_ptr.dtype.element_ty)

    # Keys the tile may see: [kv_lo, kv_hi), kv_lo aligned down to BLOCK_N.
    first_pos = ctx - q_len + q_tile_start
    last_pos = ctx - q_len + tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
    kv_hi = last_pos + 1
    kv_lo = kv_hi * 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, BLOCK_N), NUM_SPLITS)
    n_lo = kv_lo + split * tiles_per_split * BLOCK_N
    n_hi = tl.minimum(kv_hi, n_lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq * stride_bts
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [N] absolute key positions
        n_valid = offs_n < n_hi
        page = tl.load(bt_row + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
        in_page = offs_n % PAGE
        k_off = page * stride_kb + in_page * stride_kt + kv_head * stride_kh  # [N]
        k = tl.load(
            k_ptr + k_off[None, :] + offs_d[:, None] * stride_kd,
            mask=d_mask[:, None] & n_valid[None, :],
            other=0.0,
        ).to(tl.float32)  # [D, N]
        if NATIVE_DOT:
            s = tl.dot(q, k.to(q_ptr.dtype.element_ty))
        elif IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale  # [M, N], base 2
        if HAS_SOFTCAP:  # softcap * tanh(scale * q.k / softcap), base 2
            s = _tanh(s) * softcap_log2
        visible = row_valid[:, None] & n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = page * stride_vb + in_page * stride_vt + kv_head * stride_vh  # [N]
        v = tl.load(
            v_ptr + v_off[:, None] + offs_d[None, :] * stride_vd,
            mask=n_valid[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [N, D]
        if NATIVE_DOT:
            pv = tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        elif IEEE_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    io_mask = row_valid[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        o_ptrs = (
            out_ptr
            + split * stride_os
            + token[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :]
        )
        tl.store(o_ptrs, out, mask=io_mask)
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + token * NUM_HEADS + head, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_tokens"])  # type: ignore[untyped-decorator]
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, Hq, D]
    partial_ptr,  # fp32 [S, T, Hq, D], contiguous
    lse_ptr,  # fp32 [S, T, Hq], contiguous
    stride_ot,
    stride_oh,
    num_tokens,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One program per token merges all heads: out = sum_s w_s o_s / sum_s w_s, w = 2^lse."""
    t = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_HEADS
    rows = (offs_s[:, None] * num_tokens + t) * NUM_HEADS + offs_h[None, :]  # [S, H]
    lse = tl.load(lse_ptr + rows, mask=h_mask[None, :], other=float("-inf"))
    lse_max = tl.max(lse, 0)  # [H]
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.math.exp2(lse - lse_max[None, :])  # [S, H]; empty splits weigh 0
    mask = h_mask[None, :, None] & (offs_d < HEAD_DIM)[None, None, :]
    parts = tl.load(
        partial_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=mask, other=0.0
    )  # [S, H, D]
    total = tl.sum(w, 0)  # [H]
    out = tl.sum(parts * w[:, :, None], 0) / tl.where(total > 0.0, total, 1.0)[:, None]
    o_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d < HEAD_DIM))


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile sizes of one launch (the same on GPU and under the interpreter)."""

    block_m: int  # rows per program: block_q tokens x G heads (padded to a power of two)
    block_q: int
    block_n: int  # key positions per inner step
    num_warps: int
    num_stages: int | None = None  # software-pipelining depth; None: Triton's default


def block_d_for(head_dim: int) -> int:
    """The head-dim tile: the head dim rounded up to a power of two, at least 16."""
    return max(16, int(triton.next_power_of_2(head_dim)))


def attention_config(
    max_query_len: int,
    num_queries_per_kv: int,
    *,
    head_dim: int,
    elem_bytes: int,
    shared_mem: int | None = None,
) -> AttentionConfig:
    """Small row tiles for decode-only batches, 64-row tiles once any sequence prefills.

    Decode walks 128 keys per step with two pipeline stages when the head dim is at most 128 and
    two stages of K and V tiles fit in ``shared_mem`` (bytes; None: no limit, the interpreter).
    On an H200 that was the fastest of 18 tile configs at every measured shape of
    ``bench/triton_decode_sweep.py`` (bf16, head dim 128, GQA 4), 1.4-2.6x faster than 64 keys
    with Triton's default stages, and the engine on the built-in model (head dim 32) ran 2.3x
    faster in fp32 and 1.9x in bf16. Elsewhere (larger head dims, fp32 at head dim 128 on an
    H200, GPUs with less shared memory) decode keeps 64 keys and Triton's default stages.
    Above head dim 128 (Gemma's 256) decode and prefill run one stage: Triton's default three
    stages of 256-wide K and V tiles would take ~192 KiB of shared memory in bf16, ~384 in fp32
    (not yet measured on a GPU; one stage needs the least).
    """
    g = num_queries_per_kv
    stages = 1 if head_dim > 128 else None
    if max_query_len <= 1:
        block_m = max(16, triton.next_power_of_2(g))
        staged = 2 * 2 * block_d_for(head_dim) * 128 * elem_bytes  # K and V, two stages
        if head_dim <= 128 and (shared_mem is None or staged <= shared_mem):
            return AttentionConfig(
                block_m=block_m, block_q=block_m // g, block_n=128, num_warps=4, num_stages=2
            )
        return AttentionConfig(
            block_m=block_m, block_q=block_m // g, block_n=64, num_warps=4, num_stages=stages
        )
    block_m = max(64, triton.next_power_of_2(g))
    return AttentionConfig(
        block_m=block_m, block_q=block_m // g, block_n=64, num_warps=4, num_stages=stages
    )


@dataclass(frozen=True, slots=True)
class TilePlan:
    """The q tiles of one step: sequence and first new token of each (device int32 tensors)."""

    tile_seq: torch.Tensor
    tile_q_start: torch.Tensor
    num_tiles: int


def plan_tiles(query_lens: Sequence[int], block_q: int, device: torch.device) -> TilePlan:
    """Cut every sequence's new tokens into tiles of ``block_q`` (built once per step)."""
    seqs: list[int] = []
    starts: list[int] = []
    for i, n in enumerate(query_lens):
        for start in range(0, n, block_q):
            seqs.append(i)
            starts.append(start)
    return TilePlan(
        tile_seq=torch.tensor(seqs, dtype=torch.int32).to(device),
        tile_q_start=torch.tensor(starts, dtype=torch.int32).to(device),
        num_tiles=len(seqs),
    )


def choose_num_splits(
    num_programs: int, max_context_len: int, block_n: int, device: torch.device
) -> int:
    """Split-K only when the grid is too small to fill the device and contexts are long."""
    target = target_num_programs(device)
    if num_programs >= target // 2 or max_context_len < 4 * block_n:
        return 1
    by_grid = target // max(num_programs, 1)
    by_len = max_context_len // (2 * block_n)  # at least two key tiles per split
    splits = min(by_grid, by_len, _MAX_SPLITS)
    return 1 if splits < 2 else 1 << int(math.log2(splits))


def _check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    query_ok = query.dim() == 3 and query.stride(-1) == 1
    assert query_ok, (
        f"query must be [T, Hq, D] with a contiguous last dim, got {tuple(query.shape)} "
        f"strides {query.stride()}"
    )
    caches_ok = key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert caches_ok, (
        f"caches must be logical [blocks, block_size, Hkv, D] views of one shape, got "
        f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
    )
    assert key_cache.dtype == value_cache.dtype == query.dtype, (
        f"dtypes differ: query {query.dtype}, K {key_cache.dtype}, V {value_cache.dtype}"
    )
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    fits = query.shape[2] == head_dim and query.shape[1] % kv_heads == 0
    assert fits, f"query {tuple(query.shape)} does not fit {kv_heads} KV heads of dim {head_dim}"
    assert query.device == key_cache.device == value_cache.device, "tensors on different devices"


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: Sequence[int],
    max_context_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    plan: TilePlan | None = None,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """query [T, Hq, D] over logical caches [blocks, block_size, Hkv, D] -> [T, Hq, D].

    ``block_tables`` [S, max_blocks], ``query_start_loc`` [S+1], ``context_lens`` [S] are int64
    on the device; ``query_lens`` and ``max_context_len`` are their host-side facts. ``softcap``
    (> 0; None: none) caps the scores at ``softcap * tanh(scores / softcap)``. ``plan`` is
    ``plan_tiles(query_lens, config.block_q)`` when the caller caches it across layers.
    ``config`` overrides ``attention_config``'s tiles (for tuning; a given ``plan`` must use its
    ``block_q``).
    """
    _check_inputs(query, key_cache, value_cache)
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc)):
        assert t.dtype == torch.int64, f"{name} must be int64, got {t.dtype}"
        assert t.stride(-1) == 1, f"{name} needs a contiguous last dim"
    assert context_lens.dtype == torch.int64, (
        f"context_lens must be int64, got {context_lens.dtype}"
    )
    assert context_lens.is_contiguous(), "context_lens must be contiguous"
    assert block_tables.dim() == 2, f"block_tables must be 2-D, got {tuple(block_tables.shape)}"
    assert block_tables.shape[0] == len(query_lens), "one block-table row per sequence"
    num_tokens, num_heads, head_dim = query.shape
    page, kv_heads = key_cache.shape[1], key_cache.shape[2]
    g = num_heads // kv_heads
    cfg = config or attention_config(
        max(query_lens, default=0),
        g,
        head_dim=head_dim,
        elem_bytes=key_cache.element_size(),
        shared_mem=max_shared_mem(query.device),
    )
    assert cfg.block_m >= cfg.block_q * g, f"{cfg} does not hold {g} heads per token"
    if plan is None:
        plan = plan_tiles(query_lens, cfg.block_q, query.device)
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape, f"out {tuple(out.shape)} vs query {tuple(query.shape)}"
    assert out.stride(-1) == 1, "out needs a contiguous last dim"
    assert out.dtype == query.dtype, f"out dtype {out.dtype} vs query {query.dtype}"
    if plan.num_tiles == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(
            plan.num_tiles * kv_heads, max_context_len, cfg.block_n, query.device
        )
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    assert num_splits & (num_splits - 1) == 0, f"num_splits must be a power of 2, got {num_splits}"
    assert softcap is None or softcap > 0, f"softcap must be > 0 or None, got {softcap}"
    block_d = block_d_for(head_dim)
    dtype = key_cache.dtype
    native = dtype in (torch.float16, torch.bfloat16) and not (
        dtype == torch.bfloat16 and is_interpreted(_paged_attention_kernel)
    )
    if num_splits == 1:
        dest, lse = out, out  # lse unused
        stride_os, stride_ls = 0, 0
    else:
        dest = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=query.device
        )
        lse = torch.empty(
            (num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device
        )
        stride_os, stride_ls = dest.stride(0), lse.stride(0)
    grid = (plan.num_tiles, kv_heads, num_splits)
    _paged_attention_kernel[grid](
        dest,
        lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        plan.tile_seq,
        plan.tile_q_start,
        scale * _LOG2E if softcap is None else scale / softcap,
        0.0 if softcap is None else softcap * _LOG2E,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        dest.stride(-3),
        dest.stride(-2),
        stride_os,
        stride_ls,
        *key_cache.stride(),
        *value_cache.stride(),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        G=g,
        PAGE=page,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        NATIVE_DOT=native,
        IEEE_DOT=dtype == torch.float32,
        num_warps=cfg.num_warps,
        **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens,)](
            out,
            dest,
            lse,
            out.stride(0),
            out.stride(1),
            num_tokens,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            num_warps=4,
        )
    return out


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Float64 torch reference over the same logical caches; returns float64 [T, Hq, D]."""
    num_heads = query.shape[1]
    page, kv_heads = key_cache.shape[1], key_cache.shape[2]
    g = num_heads // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    start = 0
    for i, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        pos = torch.arange(ctx, device=query.device)
        pages = block_tables[i, pos // page]
        keys = key_cache[pages, pos % page].double()  # [ctx, Hkv, D]
        values = value_cache[pages, pos % page].double()
        keys = keys.repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        values = values.repeat_interleave(g, dim=1).transpose(0, 1)
        q = query[start : start + q_len].double().transpose(0, 1)  # [Hq, q, D]
        scores = (q @ keys.transpose(1, 2)) * scale  # [Hq, q, ctx]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
        visible = pos[None, :] <= q_pos
        if sliding_window is not None:
            visible &= pos[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = (scores.softmax(-1) @ values).transpose(0, 1)
        start += q_len
    return out
