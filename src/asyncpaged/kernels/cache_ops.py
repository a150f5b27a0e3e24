"""Triton cache writes: ``reshape_and_cache`` (new K/V rows into slots) and ``copy_blocks`` (CoW).

Both take the cache as described in ``paged_attention``: ``reshape_and_cache`` writes through a
logical view ``[num_blocks, block_size, kv_heads, head_dim]`` (any strides); ``copy_blocks`` copies
whole blocks of the all-layer tensors ``[num_layers, num_blocks, ...]`` whose blocks are contiguous
(the runner's ``PagedKVCache`` and vLLM's per-block NHD layout both are).

Slot of a token = ``block * block_size + offset``; slot ``-1`` skips the row. Rows are copied
without arithmetic when K/V and the cache share a dtype (the interpreter rounds fp32 -> bf16 by
truncation, the GPU to nearest: keep dtypes equal, as the runner does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_BLOCK_T = 32  # tokens per reshape_and_cache program
_COPY_CHUNK = 1024  # elements per copy_blocks inner step


@triton.jit(do_not_specialize=["num_tokens"])  # type: ignore[untyped-decorator]
def _reshape_and_cache_kernel(  # type: ignore[no-untyped-def]
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # logical [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckb,
    stride_ckt,
    stride_ckh,
    stride_ckd,
    stride_cvb,
    stride_cvt,
    stride_cvh,
    stride_cvd,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    t_mask = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=t_mask, other=-1)
    valid = t_mask & (slot >= 0)
    page = tl.where(valid, slot // PAGE, 0)
    in_page = tl.where(valid, slot % PAGE, 0)
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + offs_t[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask)
    v = tl.load(value_ptr + offs_t[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask)
    k_dst = page * stride_ckb + in_page * stride_ckt + head * stride_ckh
    v_dst = page * stride_cvb + in_page * stride_cvt + head * stride_cvh
    tl.store(
        k_cache_ptr + k_dst[:, None] + offs_d[None, :] * stride_ckd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask,
    )
    tl.store(
        v_cache_ptr + v_dst[:, None] + offs_d[None, :] * stride_cvd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into logical caches [blocks, block_size, Hkv, D] at slots [T]."""
    shapes_ok = key.dim() == 3 and key.shape == value.shape
    assert shapes_ok, f"key/value must be [T, Hkv, D], got {tuple(key.shape)}, {tuple(value.shape)}"
    assert max(key.stride(-1), value.stride(-1)) == 1, "key/value need a contiguous last dim"
    caches_ok = key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert caches_ok, f"caches must be logical [blocks, page, Hkv, D], got {tuple(key_cache.shape)}"
    assert key.shape[1:] == key_cache.shape[2:], (
        f"rows {tuple(key.shape)} do not fit cache {tuple(key_cache.shape)}"
    )
    slots_ok = slot_mapping.dtype == torch.int64 and slot_mapping.shape == (key.shape[0],)
    assert slots_ok, (
        f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} "
        f"{tuple(slot_mapping.shape)}"
    )
    assert slot_mapping.is_contiguous()
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, _BLOCK_T), kv_heads)
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride(),
        *value_cache.stride(),
        PAGE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=_BLOCK_T,
    )


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The same write in plain torch indexing."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page_size = key_cache.shape[1]
    key_cache[slots // page_size, slots % page_size] = key[keep].to(key_cache.dtype)
    value_cache[slots // page_size, slots % page_size] = value[keep].to(value_cache.dtype)


@triton.jit  # type: ignore[untyped-decorator]
def _copy_blocks_kernel(  # type: ignore[no-untyped-def]
    key_ptr,  # [L, num_blocks, ...] with contiguous blocks
    value_ptr,
    src_ptr,  # [P] int64
    dst_ptr,  # [P] int64
    stride_kl,
    stride_kb,
    stride_vl,
    stride_vb,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    k_src = key_ptr + layer * stride_kl + src * stride_kb
    k_dst = key_ptr + layer * stride_kl + dst * stride_kb
    v_src = value_ptr + layer * stride_vl + src * stride_vb
    v_dst = value_ptr + layer * stride_vl + dst * stride_vb
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(k_dst + offs, tl.load(k_src + offs, mask), mask)
        tl.store(v_dst + offs, tl.load(v_src + offs, mask), mask)


def _is_block_contiguous(cache: torch.Tensor) -> bool:
    return cache[0, 0].is_contiguous() and cache.stride(1) >= cache[0, 0].numel()


def copy_blocks(key: torch.Tensor, value: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write over every layer in one launch: block ``src`` onto ``dst`` for each pair.

    ``key``/``value`` are all-layer caches ``[L, num_blocks, ...]`` with contiguous blocks. A
    launch has no read-before-write order across pairs, so no block may be both a source and a
    destination, and destinations are distinct (true of CoW: destinations are fresh blocks).
    """
    if not pairs:
        return
    assert key.shape[:2] == value.shape[:2], f"{tuple(key.shape)} vs {tuple(value.shape)}"
    assert key.device == value.device, "K and V on different devices"
    assert all(map(_is_block_contiguous, (key, value))), (
        f"copy_blocks needs contiguous blocks, got strides {key.stride()} / {value.stride()}"
    )
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    assert len(set(dsts)) == len(dsts), f"duplicate destination blocks in {pairs}"
    assert not set(srcs) & set(dsts), f"a block is both a source and a destination in {pairs}"
    num_blocks = key.shape[1]
    assert all(0 <= b < num_blocks for b in srcs + dsts), f"block id out of range in {pairs}"
    idx = torch.tensor([srcs, dsts], dtype=torch.int64).to(key.device)
    numel = key[0, 0].numel()
    assert value[0, 0].numel() == numel, "K and V blocks differ in size"
    _copy_blocks_kernel[(len(pairs), key.shape[0])](
        key,
        value,
        idx[0],
        idx[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        BLOCK_NUMEL=numel,
        CHUNK=min(_COPY_CHUNK, triton.next_power_of_2(numel)),
    )


def copy_blocks_reference(
    key: torch.Tensor, value: torch.Tensor, pairs: Sequence[tuple[int, int]]
) -> None:
    """The same copy as one indexed torch copy per tensor."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=key.device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=key.device)
    key[:, dst] = key[:, src]
    value[:, dst] = value[:, src]
