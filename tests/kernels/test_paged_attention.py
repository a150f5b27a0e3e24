"""Paged attention kernel vs a float64 torch reference, under the interpreter (or natively)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from asyncpaged.kernels._util import is_interpreted, max_shared_mem
from asyncpaged.kernels.cache_ops import _reshape_and_cache_kernel, reshape_and_cache
from asyncpaged.kernels.paged_attention import (
    AttentionConfig,
    _merge_splits_kernel,
    _paged_attention_kernel,
    attention_config,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
)
from tests.kernels.cases import PAGE, TOLERANCE, Layout, PagedCase, make_case
from tests.kernels.conftest import NATIVE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 1), (2, 4), (1, 6)]  # (kv heads, query heads per kv head)
DECODE_LENS = [1, 15, 16, 17, 40, 300]
# decode, full prefills at 15/16/17, a chunk after 23 cached tokens, a prefix hit, a long decode
MIXED_QUERY_LENS = [1, 15, 16, 17, 7, 1]
MIXED_CONTEXT_LENS = [17, 15, 16, 40, 100, 300]


def _run(
    case: PagedCase,
    *,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    return paged_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        block_tables=case.block_tables,
        query_start_loc=case.query_start_loc,
        context_lens=case.context_lens,
        query_lens=case.query_lens,
        max_context_len=max(case.context_lens_host),
        scale=case.query.shape[-1] ** -0.5,
        sliding_window=window,
        softcap=softcap,
        num_splits=num_splits,
        config=config,
    )


def _check(
    case: PagedCase,
    out: torch.Tensor,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> float:
    """Asserts ``out`` matches the float64 reference; returns the max abs error."""
    ref = paged_attention_reference(
        case.query,
        case.key_cache,
        case.value_cache,
        block_tables=case.block_tables,
        query_lens=case.query_lens,
        context_lens=case.context_lens_host,
        scale=case.query.shape[-1] ** -0.5,
        sliding_window=window,
        softcap=softcap,
    )
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    assert torch.isfinite(out).all(), "a NaN-poisoned slot was read"
    tol = TOLERANCE[case.query.dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    return float((out.double() - ref).abs().max())


def _decode_case(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, device: torch.device
) -> PagedCase:
    return make_case(
        query_lens=[1] * len(DECODE_LENS),
        context_lens=DECODE_LENS,
        kv_heads=heads[0],
        group=heads[1],
        head_dim=head_dim,
        dtype=dtype,
        device=device,
    )


def _mixed_case(
    dtype: torch.dtype,
    heads: tuple[int, int],
    device: torch.device,
    *,
    head_dim: int = 64,
    layout: Layout = "runner",
) -> PagedCase:
    return make_case(
        query_lens=MIXED_QUERY_LENS,
        context_lens=MIXED_CONTEXT_LENS,
        kv_heads=heads[0],
        group=heads[1],
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        layout=layout,
        seed=1,
    )


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"kv{h[0]}xg{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, device: torch.device
) -> None:
    case = _decode_case(dtype, heads, head_dim, device)
    _check(case, _run(case, num_splits=1))


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("heads", [(2, 4), (1, 6)], ids=lambda h: f"kv{h[0]}xg{h[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_with_64_key_tiles_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], num_splits: int, device: torch.device
) -> None:
    """The decode tiles of GPUs with less shared memory (the interpreter has no limit, so the
    other tests run the 128-key tiles)."""
    config = attention_config(1, heads[1], head_dim=80, elem_bytes=dtype.itemsize, shared_mem=0)
    assert config.block_n == 64
    case = _decode_case(dtype, heads, 80, device)
    _check(case, _run(case, num_splits=num_splits, config=config))


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"kv{h[0]}xg{h[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_decode_prefill_chunk_batch_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], device: torch.device
) -> None:
    case = _mixed_case(dtype, heads, device)
    _check(case, _run(case))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_head_dim_256(num_splits: int, device: torch.device) -> None:
    """Gemma's head dim: a 256-wide head-dim tile; decode on the 64-key tiles (head dims above
    128), a mixed batch on the prefill tiles."""
    assert attention_config(1, 4, head_dim=256, elem_bytes=4).block_n == 64
    assert attention_config(7, 2, head_dim=256, elem_bytes=2).num_stages == 1
    decode = make_case(query_lens=[1, 1, 1], context_lens=[17, 40, 300], kv_heads=2, group=4,
                       head_dim=256, dtype=torch.float32, device=device, seed=3)  # fmt: skip
    _check(decode, _run(decode, num_splits=num_splits))
    mixed = make_case(query_lens=[1, 17, 7], context_lens=[33, 17, 40], kv_heads=1, group=2,
                      head_dim=256, dtype=torch.float16, device=device, seed=4)  # fmt: skip
    _check(mixed, _run(mixed, num_splits=num_splits))


@pytest.mark.parametrize("layout", ["runner", "nhd"])
def test_mixed_batch_head_dim_80_in_both_cache_layouts(
    layout: Layout, device: torch.device
) -> None:
    case = _mixed_case(torch.float16, (2, 4), device, head_dim=80, layout=layout)
    _check(case, _run(case))


@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_k_decode_matches_reference(
    dtype: torch.dtype, num_splits: int, device: torch.device
) -> None:
    case = _decode_case(dtype, (2, 4), 64, device)
    _check(case, _run(case, num_splits=num_splits))


@pytest.mark.parametrize("heads", [(2, 4), (1, 6)], ids=lambda h: f"kv{h[0]}xg{h[1]}")
def test_split_k_mixed_batch_with_causal_rows_matches_reference(
    heads: tuple[int, int], device: torch.device
) -> None:
    # Splits of a prefill tile that lie past a row's position are empty for it (lse = -inf).
    case = _mixed_case(torch.float32, heads, device)
    _check(case, _run(case, num_splits=4))


def test_split_k_heuristic_engages_for_few_long_decodes(device: torch.device) -> None:
    cfg = attention_config(1, 4, head_dim=64, elem_bytes=2, shared_mem=max_shared_mem(device))
    long = 4 * cfg.block_n + 8  # past the shortest context the heuristic splits; a partial page
    case = make_case(
        query_lens=[1, 1],
        context_lens=[long, 17],
        kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.float16,
        device=device,
    )
    assert choose_num_splits(2 * 2, long, cfg.block_n, device) > 1
    _check(case, _run(case))


def test_decode_tiles_follow_dtype_head_dim_and_shared_memory() -> None:
    def decode(head_dim: int, elem_bytes: int, shared_mem: int | None = None) -> tuple[int, ...]:
        cfg = attention_config(1, 4, head_dim=head_dim, elem_bytes=elem_bytes,
                               shared_mem=shared_mem)  # fmt: skip
        assert cfg.block_q == 4  # the same tile plan either way
        return cfg.block_n, cfg.num_warps, cfg.num_stages or 0

    wide, narrow = (128, 4, 2), (64, 4, 0)
    assert decode(32, 4) == decode(80, 2) == decode(128, 4) == wide  # no limit: interpreter
    assert decode(256, 2) == (64, 4, 1)  # larger head dims: one stage (not measured)
    h200 = 227 * 1024
    assert decode(128, 2, h200) == decode(64, 4, h200) == decode(32, 4, h200) == wide
    assert decode(128, 4, h200) == narrow  # two fp32 stages of K and V: 256 KiB
    assert decode(128, 2, 99 * 1024) == narrow  # two 16-bit stages: 128 KiB
    assert decode(64, 2, 99 * 1024) == wide
    prefill = attention_config(5, 4, head_dim=64, elem_bytes=2)
    assert (prefill.block_m, prefill.block_n, prefill.num_stages) == (64, 64, None)


def test_shared_memory_is_unlimited_off_cuda_and_zero_without_a_driver() -> None:
    from asyncpaged.kernels import _util

    assert max_shared_mem(torch.device("cpu")) is None  # the interpreter: 128-key tiles
    if not torch.cuda.is_available():  # Triton has no active driver here: the 64-key tiles
        assert _util._cuda_shared_mem.__wrapped__(0) == 0
    else:
        assert (max_shared_mem(torch.device("cuda")) or 0) >= 48 * 1024


def test_split_k_heuristic_stays_off_for_many_programs_or_short_contexts(
    device: torch.device,
) -> None:
    assert choose_num_splits(10_000, 4096, 64, device) == 1
    assert choose_num_splits(1, 100, 64, device) == 1


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("window", [1, 8, 33])
def test_sliding_window_matches_reference(
    window: int, num_splits: int, device: torch.device
) -> None:
    case = _mixed_case(torch.float32, (2, 4), device)
    _check(case, _run(case, num_splits=num_splits, window=window), window=window)


def test_strided_query_and_output_rows(device: torch.device) -> None:
    """Query as a slice of a fused qkv projection; the output written into a wider buffer."""
    case = _mixed_case(torch.float16, (2, 4), device)
    num_tokens, num_heads, head_dim = case.query.shape
    qkv = torch.randn(num_tokens, num_heads + 4, head_dim, dtype=torch.float16, device=device)
    qkv[:, :num_heads] = case.query
    case.query = qkv[:, :num_heads]
    wide = torch.full(
        (num_tokens, num_heads + 3, head_dim), 7.0, dtype=torch.float16, device=device
    )
    out = paged_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        block_tables=case.block_tables,
        query_start_loc=case.query_start_loc,
        context_lens=case.context_lens,
        query_lens=case.query_lens,
        max_context_len=max(case.context_lens_host),
        scale=head_dim**-0.5,
        out=wide[:, :num_heads],
    )
    _check(case, out)
    assert bool((wide[:, num_heads:] == 7.0).all()), "wrote outside the output rows"


def test_rejects_mismatched_shapes(device: torch.device) -> None:
    case = _decode_case(torch.float32, (2, 4), 64, device)
    with pytest.raises(AssertionError, match="does not fit"):
        paged_attention(
            case.query[:, :, :32].contiguous(),
            case.key_cache,
            case.value_cache,
            block_tables=case.block_tables,
            query_start_loc=case.query_start_loc,
            context_lens=case.context_lens,
            query_lens=case.query_lens,
            max_context_len=300,
            scale=1.0,
        )


@pytest.mark.skipif(not NATIVE, reason="a cache past 2^31 elements (~9 GB): CUDA only")
def test_block_offsets_past_the_int32_range(device: torch.device) -> None:
    kv_heads, group, head_dim, dtype = 8, 4, 128, torch.float16
    num_blocks = 2**31 // (PAGE * kv_heads * head_dim) + 64
    nan = float("nan")
    key = torch.full((num_blocks, kv_heads, head_dim, PAGE), nan, dtype=dtype, device=device)
    value = torch.full((num_blocks, kv_heads, PAGE, head_dim), nan, dtype=dtype, device=device)
    key_cache, value_cache = key.permute(0, 3, 1, 2), value.permute(0, 2, 1, 3)
    query_lens, context_lens = [1, 17], [40, 17]
    tables = [[num_blocks - 1, num_blocks - 3, num_blocks - 5], [num_blocks - 2, num_blocks - 4, 0]]
    block_tables = torch.tensor(tables, dtype=torch.int64, device=device)
    slots = []
    for table, q_len, ctx in zip(tables, query_lens, context_lens, strict=True):
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(ctx - q_len, ctx)]
        for p in range(ctx - q_len):
            key_cache[table[p // PAGE], p % PAGE] = torch.randn(kv_heads, head_dim, device=device)
            value_cache[table[p // PAGE], p % PAGE] = torch.randn(kv_heads, head_dim, device=device)
    new = torch.randn(2, len(slots), kv_heads, head_dim, device=device).to(dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    reshape_and_cache(new[0], new[1], key_cache, value_cache, slot_mapping)
    case = PagedCase(
        query=torch.randn(len(slots), kv_heads * group, head_dim, device=device).to(dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        query_start_loc=torch.tensor([0, 1, 18], dtype=torch.int64, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
        query_lens=query_lens,
        context_lens_host=context_lens,
        slot_mapping=slot_mapping,
        new_key=new[0],
        new_value=new[1],
    )
    _check(case, _run(case))
    _check(case, _run(case, num_splits=2))


@pytest.mark.parametrize(
    ("kernel", "varying"),
    [
        (_paged_attention_kernel, {"stride_os", "stride_ls", "stride_bts"}),
        (_merge_splits_kernel, {"num_tokens"}),
        (_reshape_and_cache_kernel, {"num_tokens"}),
    ],
    ids=["attention", "merge", "cache_write"],
)
def test_step_varying_integers_are_not_specialized(kernel: Any, varying: set[str]) -> None:
    """Triton ignores a misspelt name here silently, and a specialized step-varying integer
    recompiles the kernel mid-run whenever it becomes 1 or a multiple of 16."""
    declared = (
        kernel.kwargs["do_not_specialize"] if is_interpreted(kernel) else kernel.do_not_specialize
    )
    assert set(declared) == varying
    assert varying <= set(inspect.signature(kernel.fn).parameters)


def test_benchmark_inputs_give_the_reference_attention_in_both_layouts(
    device: torch.device,
) -> None:
    """The GPU benchmark's decode batch (kernels/benchmark.py), run here on small shapes: its
    runner-layout views, NHD copies, arguments and tile plan give the reference attention."""
    from asyncpaged.kernels.benchmark import decode_inputs

    inputs = decode_inputs(3, 48, num_heads=8, kv_heads=2, head_dim=64, dtype=torch.float32,
                           device=device.type)  # fmt: skip
    k_view, v_view = inputs.runner_views()
    meta = inputs.meta
    ref = paged_attention_reference(
        inputs.query, k_view, v_view, block_tables=meta["block_tables"],
        query_lens=meta["query_lens"], context_lens=[48] * 3, scale=meta["scale"],
    )  # fmt: skip
    assert inputs.kv_bytes == 2 * 3 * 48 * 2 * 64 * 4
    for k, v in ((k_view, v_view), (k_view.contiguous(), v_view.contiguous())):
        out = paged_attention(inputs.query, k, v, **meta, plan=inputs.plan)
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
