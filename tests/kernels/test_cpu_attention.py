"""The native CPU kernels (``kernels/csrc/``: paged decode, paged prefill, the K/V cache write)
and the backend that uses them.

Every attention case is checked against a float64 reference on random data, in a cache where
every slot no sequence owns, and block 0 (the padding entry of the block tables), hold NaN: a
stray read shows as NaN. Prefill cases cover new lengths 1/15/16/17/257 on cached prefixes of
0/16/17 tokens (full prefill, prefix hits, chunks). The cache write is compared bit for bit with
``PagedKVCache.write``. Quantized caches (int8, fp8 e4m3 / e5m2: codes with a bfloat16 scale per
token, unused codes and scales NaN-poisoned too) are checked against the same float64
reference on their dequantized values, and their write bit for bit against ``kv_quant``'s
rounding. Block tables are scattered over a pool of 2048 blocks. The build
targets the CPU cannot run are skipped with the missing flags; without g++ the kernel tests skip
and the fallback tests still run. Builds are cached under ``ASYNCPAGED_CACHE_DIR`` (the first run
compiles each target, about 10-15 s each).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from asyncpaged.kernels import cpu_attention, cpu_build
from asyncpaged.kernels.cpu_attention import (
    CpuAttentionBackend,
    DecodePlan,
    make_cpu_attention_backend,
    paged_decode_attention,
    reference_paged_decode,
)
from asyncpaged.kernels.cpu_ops import (
    SUPPORTED_HEAD_DIMS,
    paged_cache_write,
    paged_prefill_attention,
    reference_paged_prefill,
)
from asyncpaged.model.attention import AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.kv_quant import KV_SCALE_DTYPE, fill_code, is_quantized, quantize

NUM_BLOCKS, BLOCK = 2048, 16
LENGTHS = (1, 15, 16, 17, 257)
PREFILL_SHAPES = tuple((cached, new) for cached in (0, 16, 17) for new in LENGTHS)  # (cached, new)
NAN = float("nan")
QUANTIZED = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
QUANTIZED_IDS = ["int8", "e4m3", "e5m2"]

needs_compiler = pytest.mark.skipif(cpu_build.find_compiler() is None, reason="g++ not found")


@dataclass
class Case:
    query: torch.Tensor  # [S, Hq, D]
    key_cache: torch.Tensor  # [NUM_BLOCKS, Hkv, D, BLOCK]
    value_cache: torch.Tensor  # [NUM_BLOCKS, Hkv, BLOCK, D]
    block_tables: torch.Tensor  # [S, width], padded with block 0
    context_lens: torch.Tensor  # [S]
    scale: float
    key_scale: torch.Tensor | None = None  # [NUM_BLOCKS, Hkv, BLOCK]: a quantized cache's
    value_scale: torch.Tensor | None = None

    def run(
        self,
        window: int | None = None,
        *,
        softcap: float | None = None,
        num_threads: int | None = None,
        target: str | None = None,
    ) -> torch.Tensor:
        return paged_decode_attention(
            self.query, self.key_cache, self.value_cache, self.block_tables, self.context_lens,
            self.scale, window, softcap=softcap, num_threads=num_threads, target=target,
            key_scale=self.key_scale, value_scale=self.value_scale,
        )  # fmt: skip

    def reference(self, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        return reference_paged_decode(
            self.query, self.key_cache, self.value_cache, self.block_tables,
            self.context_lens, self.scale, window, softcap,
            key_scale=self.key_scale, value_scale=self.value_scale,
        )  # fmt: skip


def make_case(
    *,
    head_dim: int = 64,
    kv_heads: int = 2,
    heads: int = 8,
    dtype: torch.dtype = torch.float32,
    lengths: tuple[int, ...] = LENGTHS,
    seed: int = 0,
    query_scale: float = 1.0,
) -> Case:
    """Random K/V for each sequence's positions only, in blocks drawn from the whole pool; a
    quantized ``dtype`` stores them as ``kv_quant`` rounds them (rows over magnitudes 2^-6..2,
    one K and one V row all zero: scale 0), its unused codes and scales poisoned."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    fill = fill_code(dtype, NAN) if is_quantized(dtype) else NAN
    key_cache = torch.full((NUM_BLOCKS, kv_heads, head_dim, BLOCK), fill, dtype=dtype)
    value_cache = torch.full((NUM_BLOCKS, kv_heads, BLOCK, head_dim), fill, dtype=dtype)
    key_scale = value_scale = None
    if is_quantized(dtype):
        key_scale = torch.full((NUM_BLOCKS, kv_heads, BLOCK), NAN, dtype=KV_SCALE_DTYPE)
        value_scale = key_scale.clone()
    counts = [-(-n // BLOCK) for n in lengths]
    pool = rng.sample(range(1, NUM_BLOCKS), sum(counts))  # block 0 stays NaN: the padding
    tables = torch.zeros(len(lengths), max(counts) + 2, dtype=torch.int64)
    for i, (n, count) in enumerate(zip(lengths, counts, strict=True)):
        tables[i, :count] = torch.tensor(pool[:count])
        pool = pool[count:]
        pos = torch.arange(n)
        blocks, offsets = tables[i, pos // BLOCK], pos % BLOCK
        keys = torch.randn(n, kv_heads, head_dim, generator=gen)
        values = torch.randn(n, kv_heads, head_dim, generator=gen)
        if key_scale is None or value_scale is None:
            key_cache[blocks, :, :, offsets] = keys.to(dtype)
            value_cache[blocks, :, offsets, :] = values.to(dtype)
            continue
        magnitudes = 2.0 ** torch.randint(-6, 2, (2, n, kv_heads, 1), generator=gen)
        keys, values = keys * magnitudes[0], values * magnitudes[1]
        keys[n // 2, 0], values[n - 1, -1] = 0.0, 0.0
        key_codes, k_scales = quantize(keys, dtype)
        value_codes, v_scales = quantize(values, dtype)
        key_cache[blocks, :, :, offsets], key_scale[blocks, :, offsets] = key_codes, k_scales
        value_cache[blocks, :, offsets, :], value_scale[blocks, :, offsets] = value_codes, v_scales
    query = torch.randn(len(lengths), heads, head_dim, generator=gen) * query_scale
    return Case(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        context_lens=torch.tensor(lengths, dtype=torch.int64),
        scale=head_dim**-0.5,
        key_scale=key_scale,
        value_scale=value_scale,
    )


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == torch.float32
    assert not got.isnan().any(), "NaN in the output: a masked or padding slot was read"
    tol = 2e-4 if dtype == torch.bfloat16 else 5e-5  # the reference reads the same bf16 values
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [2, 8, 12], ids=["group1", "group4", "group6"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_matches_reference(head_dim: int, heads: int, dtype: torch.dtype) -> None:
    case = make_case(head_dim=head_dim, heads=heads, dtype=dtype, seed=head_dim + heads)
    assert_matches(case.run(num_threads=1), case.reference(), dtype)
    # Few sequences: one KV head per work item (with many, the kernel takes KV heads in pairs).
    few = make_case(head_dim=head_dim, heads=heads, dtype=dtype, lengths=(17, 257), seed=1)
    assert_matches(few.run(num_threads=1), few.reference(), dtype)


@needs_compiler
@pytest.mark.parametrize(
    ("head_dim", "heads", "dtype"),
    [(16, 8, torch.int8), (64, 2, torch.float8_e4m3fn), (80, 12, torch.float8_e5m2),
     (128, 8, torch.int8), (96, 4, torch.float8_e4m3fn), (256, 4, torch.float8_e5m2)],
    ids=["16-group4-int8", "64-group1-e4m3", "80-group6-e5m2", "128-group4-int8",
         "96-group2-e4m3", "256-group2-e5m2"],
)  # fmt: skip
def test_quantized_cache_matches_reference(head_dim: int, heads: int, dtype: torch.dtype) -> None:
    """Codes and per-token scales read in registers: decode (KV heads alone and in pairs) and
    prefill (full, chunks, prefix hits), with a sliding window and softcapping; each dtype at
    two head dims here, and in every build target (``TARGET_QUANTIZED``)."""
    case = make_case(head_dim=head_dim, heads=heads, dtype=dtype, seed=head_dim + heads)
    assert_matches(case.run(num_threads=1), case.reference(), dtype)
    assert_matches(case.run(17, softcap=3.0), case.reference(17, softcap=3.0), dtype)
    few = make_case(head_dim=head_dim, heads=heads, dtype=dtype, lengths=(17, 257), seed=1)
    assert_matches(few.run(num_threads=1), few.reference(), dtype)
    shapes = ((0, 17), (16, 16), (17, 1), (17, 40), (0, 130))  # (cached, new)
    prefill = make_prefill_case(head_dim=head_dim, heads=heads, dtype=dtype, seed=head_dim,
                                shapes=shapes)  # fmt: skip
    assert_matches(prefill.run(num_threads=1), prefill.reference(), dtype)
    got = prefill.run(20, softcap=3.0, key_tile_blocks=2)  # online softmax over key tiles
    assert_matches(got, prefill.reference(20, softcap=3.0), dtype)


@needs_compiler
def test_quantized_cache_needs_its_scales() -> None:
    case = make_case(dtype=torch.int8, lengths=(5, 40))
    k_scale, v_scale = case.key_scale, case.value_scale
    assert k_scale is not None and v_scale is not None
    case.key_scale = None
    with pytest.raises(ValueError, match="needs key_scale and value_scale"):
        case.run()
    case.key_scale = k_scale.float()
    with pytest.raises(ValueError, match="key_scale must be contiguous bfloat16"):
        case.run()
    case.key_scale = k_scale
    plan = make_plan(case)
    with pytest.raises(ValueError, match="the plan takes"):
        plan.run(case.query, case.key_cache, case.value_cache)  # no scales
    with pytest.raises(ValueError, match="takes no scales"):
        paged_decode_attention(
            case.query, case.key_cache.float(), case.value_cache.float(), case.block_tables,
            case.context_lens, case.scale, key_scale=k_scale, value_scale=v_scale,
        )  # fmt: skip
    got = plan.run(case.query, case.key_cache, case.value_cache, key_scale=k_scale,
                   value_scale=v_scale)  # fmt: skip
    assert_matches(got, case.reference(), torch.int8)


@needs_compiler
@pytest.mark.parametrize("window", [1, 15, 16, 17, 100, 400])
def test_sliding_window_attends_the_last_window_positions(window: int) -> None:
    case = make_case(heads=12, lengths=(*LENGTHS, 33, 130), seed=window)
    assert_matches(case.run(window), case.reference(window), torch.float32)


# Each build target reads each quantized dtype (GQA, MHA, a window).
TARGET_QUANTIZED = (
    (torch.int8, 64, 8, None),
    (torch.float8_e4m3fn, 80, 12, 17),
    (torch.float8_e5m2, 128, 2, None),
)


@pytest.fixture(scope="module")
def target_cases() -> list[tuple[Case, int | None, torch.Tensor]]:
    """(case, window, float64 reference), built once for every target and thread count."""
    cases = []
    for dtype, head_dim, heads, window in (
        (torch.float32, 80, 12, None),
        (torch.bfloat16, 128, 8, None),
        (torch.float32, 64, 2, 17),
        (torch.bfloat16, 96, 12, 40),
        *TARGET_QUANTIZED,
    ):
        case = make_case(head_dim=head_dim, heads=heads, dtype=dtype, lengths=(*LENGTHS, 64, 3))
        cases.append((case, window, case.reference(window)))
    return cases


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_each_build_target(
    target: str, threads: int, target_cases: list[tuple[Case, int | None, torch.Tensor]]
) -> None:
    for case, window, want in target_cases:
        got = case.run(window, num_threads=threads, target=target)
        assert_matches(got, want, case.key_cache.dtype)


_THREAD_LIMIT_PROBE = """
import torch
from tests.kernels.test_cpu_attention import assert_matches, make_case
case = make_case(kv_heads=4, lengths=(300, 1, 40, 17, 257, 16, 90), heads=8)
assert_matches(case.run(num_threads=3), case.reference(), torch.float32)
"""


@needs_compiler
@pytest.mark.parametrize("threads", [3, 7, 40])
def test_thread_lists_cover_every_item(threads: int) -> None:
    # Each thread runs a fixed list of work items: with more threads than items (7 sequences
    # x 4 KV heads one at a time, or in pairs), lists are empty or short, and every item must
    # still be computed once.
    for lengths in ((300, 1, 40), (300, 1, 40, 17, 257, 16, 90)):
        case = make_case(kv_heads=4, lengths=lengths, heads=8, seed=threads)
        assert_matches(case.run(num_threads=threads), case.reference(), torch.float32)


@needs_compiler
def test_thread_lists_run_when_openmp_gives_fewer_threads() -> None:
    # OMP_THREAD_LIMIT=1: the kernel asks for 3 threads and gets 1, which must run all 3 lists.
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_THREAD_LIMIT": "1", "PYTHONPATH": str(root)}
    subprocess.run(
        [sys.executable, "-c", _THREAD_LIMIT_PROBE], env=env, cwd=root, check=True, timeout=300
    )


@needs_compiler
def test_large_scores_need_the_max_subtracted() -> None:
    case = make_case(heads=8, query_scale=40.0)  # scores in the hundreds: exp overflows alone
    assert_matches(case.run(), case.reference(), torch.float32)


@needs_compiler
def test_many_groups_and_mha() -> None:
    for kv_heads, heads in ((1, 16), (4, 4), (3, 21)):
        case = make_case(kv_heads=kv_heads, heads=heads, head_dim=64, lengths=(1, 31, 300))
        assert_matches(case.run(), case.reference(), torch.float32)


@needs_compiler
def test_block_offsets_past_int32() -> None:
    """Blocks whose element offset is > 2**31 (a 4 GiB bf16 cache per K/V, allocated lazily:
    only the used blocks are touched) must be read at the right address."""
    num_blocks, heads, kv_heads, head_dim = 1_100_000, 8, 2, 64  # block = 2048 elements
    gen = torch.Generator().manual_seed(7)
    key_cache = torch.empty((num_blocks, kv_heads, head_dim, BLOCK), dtype=torch.bfloat16)
    value_cache = torch.empty((num_blocks, kv_heads, BLOCK, head_dim), dtype=torch.bfloat16)
    lengths = (40, 17)
    tables = torch.tensor([[1_099_999, 1_050_001, 1_048_577], [1_048_576, 3, 0]])
    for i, n in enumerate(lengths):
        blocks = tables[i, : -(-n // BLOCK)]
        key_cache[blocks] = NAN
        value_cache[blocks] = NAN
        pos = torch.arange(n)
        rows, offsets = tables[i, pos // BLOCK], pos % BLOCK
        key_cache[rows, :, :, offsets] = torch.randn(n, kv_heads, head_dim, generator=gen).to(
            torch.bfloat16
        )
        value_cache[rows, :, offsets, :] = torch.randn(n, kv_heads, head_dim, generator=gen).to(
            torch.bfloat16
        )
    case = Case(
        query=torch.randn(2, heads, head_dim, generator=gen),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        context_lens=torch.tensor(lengths),
        scale=0.125,
    )
    assert_matches(case.run(), case.reference(), torch.bfloat16)


@needs_compiler
def test_strided_query_rows_and_preallocated_out() -> None:
    case = make_case(heads=8)
    num_seqs = case.query.shape[0]
    wide = torch.full((num_seqs, 10, 64), NAN)
    wide[:, 1:9] = case.query  # rows [Hq, D] are contiguous, the row stride is 10 * D
    out_wide = torch.full((num_seqs, 9, 64), NAN)
    out = out_wide[:, :8]
    returned = paged_decode_attention(
        wide[:, 1:9], case.key_cache, case.value_cache, case.block_tables, case.context_lens,
        case.scale, out=out,
    )  # fmt: skip
    assert returned is out
    assert_matches(out, case.reference(), torch.float32)
    assert out_wide[:, 8].isnan().all(), "wrote outside out"


@needs_compiler
def test_rejects_bad_inputs_with_clear_errors() -> None:
    case = make_case(lengths=(5, 40))
    with pytest.raises(ValueError, match="query must be float32"):
        paged_decode_attention(
            case.query.double(), case.key_cache, case.value_cache, case.block_tables,
            case.context_lens, case.scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="head_dim must be one of"):
        small = make_case(head_dim=8, lengths=(5,))
        small.run()
    with pytest.raises(ValueError, match="sliding_window must be > 0"):
        case.run(0)
    with pytest.raises(ValueError, match="int64"):
        paged_decode_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables.int(),
            case.context_lens, case.scale,
        )  # fmt: skip
    bad_table = case.block_tables.clone()
    bad_table[1, 2] = NUM_BLOCKS  # in use (40 tokens = 3 blocks), out of range
    with pytest.raises(ValueError, match="outside"):
        paged_decode_attention(
            case.query, case.key_cache, case.value_cache, bad_table, case.context_lens,
            case.scale,
        )  # fmt: skip
    too_long = torch.tensor([5, 16 * case.block_tables.shape[1] + 1])
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_decode_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables, too_long,
            case.scale,
        )  # fmt: skip


# --- decode plans --------------------------------------------------------------------------------


def make_plan(case: Case, window: int | None = None, **kwargs: Any) -> DecodePlan:
    return DecodePlan(
        case.query, case.key_cache, case.value_cache, case.block_tables, case.context_lens,
        case.scale, window, key_scale=case.key_scale, value_scale=case.value_scale, **kwargs,
    )  # fmt: skip


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "window"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 20)]
)
def test_plan_runs_the_same_kernel(dtype: torch.dtype, window: int | None, threads: int) -> None:
    # Two layers (other K/V in the same blocks, another query) through one plan: each run
    # equals a fresh one-off plan (the one-call function) bit for bit, and the float64
    # reference: nothing of the first run leaks into the second.
    first = make_case(dtype=dtype, heads=8, seed=5)
    gen = torch.Generator().manual_seed(6)
    second = Case(
        query=torch.randn(first.query.shape, generator=gen),
        key_cache=first.key_cache + torch.randn(first.key_cache.shape, generator=gen).to(dtype),
        value_cache=first.value_cache * 2,
        block_tables=first.block_tables,
        context_lens=first.context_lens,
        scale=first.scale,
    )
    plan = make_plan(first, window)
    for case in (first, second):
        got = plan.run(case.query, case.key_cache, case.value_cache, num_threads=threads)
        assert torch.equal(got, case.run(window, num_threads=threads))
        assert_matches(got, case.reference(window), dtype)


@needs_compiler
def test_plan_selected_sequences_and_rows() -> None:
    # Sequences 4, 1, 3 of the tables write query rows 0, 2, 5; the other rows are left alone.
    case = make_case(lengths=(1, 15, 16, 17, 257, 40))
    seqs = torch.tensor([4, 1, 3])
    rows = torch.tensor([0, 2, 5])
    plan = make_plan(case, seq_indices=seqs, query_rows=rows)
    out = torch.full_like(case.query, 7.0)
    plan.run(case.query, case.key_cache, case.value_cache, out)
    for seq, row in zip(seqs.tolist(), rows.tolist(), strict=True):
        pair = reference_paged_decode(
            case.query[row : row + 1], case.key_cache, case.value_cache,
            case.block_tables[seq : seq + 1], case.context_lens[seq : seq + 1], case.scale,
        )  # fmt: skip
        assert_matches(out[row : row + 1], pair, torch.float32)
    untouched = [r for r in range(case.query.shape[0]) if r not in rows.tolist()]
    assert (out[untouched] == 7.0).all()


@needs_compiler
def test_plan_keeps_its_own_copy_of_the_tables() -> None:
    case = make_case(lengths=(17, 257, 40))
    plan = make_plan(case)
    want = case.reference()
    case.block_tables.zero_()  # block 0 is NaN padding: a plan reading these would return NaN
    case.context_lens.fill_(10**6)
    assert_matches(plan.run(case.query, case.key_cache, case.value_cache), want, torch.float32)


@needs_compiler
def test_plan_checks_indices_once_and_tensors_every_run() -> None:
    case = make_case(lengths=(5, 40))
    bad_table = case.block_tables.clone()
    bad_table[1, 2] = NUM_BLOCKS  # in use (40 tokens = 3 blocks), out of range
    with pytest.raises(ValueError, match="outside"):
        DecodePlan(case.query, case.key_cache, case.value_cache, bad_table, case.context_lens,
                   case.scale)  # fmt: skip
    with pytest.raises(ValueError, match="out of range"):
        make_plan(case, seq_indices=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="out of range"):
        make_plan(case, query_rows=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="int64"):
        make_plan(case, seq_indices=torch.tensor([0, 1], dtype=torch.int32))
    plan = make_plan(case)
    out = torch.full_like(case.query, 7.0)
    smaller = case.key_cache[: NUM_BLOCKS // 2].contiguous(), case.value_cache[: NUM_BLOCKS // 2]
    others: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = [
        (case.query[:1], case.key_cache, case.value_cache),  # fewer rows
        (case.query.double(), case.key_cache, case.value_cache),
        (case.query, *smaller),  # a cache with fewer blocks than the plan checked against
        (case.query, case.key_cache.bfloat16(), case.value_cache.bfloat16()),
        (case.query, case.key_cache.transpose(0, 1).contiguous().transpose(0, 1),
         case.value_cache),  # not contiguous
    ]  # fmt: skip
    for query, key_cache, value_cache in others:
        with pytest.raises(ValueError, match="the plan takes"):
            plan.run(query, key_cache, value_cache, out)
    with pytest.raises(ValueError, match="out must be"):
        plan.run(case.query, case.key_cache, case.value_cache, out[:1])
    assert (out == 7.0).all()  # nothing was written


# --- prefill -------------------------------------------------------------------------------------


@dataclass
class PrefillCase:
    query: torch.Tensor  # [T, Hq, D]: the new rows of every sequence, back to back
    key_cache: torch.Tensor  # every context position written (cached prefix and new rows)
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor  # [S+1]
    context_lens: torch.Tensor  # [S] cached + new
    scale: float
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    def run(self, window: int | None = None, **kwargs: Any) -> torch.Tensor:
        return paged_prefill_attention(
            self.query, self.key_cache, self.value_cache, self.block_tables,
            self.query_start_loc, self.context_lens, self.scale, window,
            key_scale=self.key_scale, value_scale=self.value_scale, **kwargs,
        )  # fmt: skip

    def reference(self, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        return reference_paged_prefill(
            self.query, self.key_cache, self.value_cache, self.block_tables,
            self.query_start_loc, self.context_lens, self.scale, window, softcap,
            key_scale=self.key_scale, value_scale=self.value_scale,
        )  # fmt: skip


def make_prefill_case(
    *,
    head_dim: int = 64,
    kv_heads: int = 2,
    heads: int = 8,
    dtype: torch.dtype = torch.float32,
    shapes: tuple[tuple[int, int], ...] = PREFILL_SHAPES,
    seed: int = 0,
    query_scale: float = 1.0,
) -> PrefillCase:
    base = make_case(
        head_dim=head_dim, kv_heads=kv_heads, heads=heads, dtype=dtype, seed=seed,
        lengths=tuple(c + n for c, n in shapes),
    )  # fmt: skip
    starts = [0]
    for _, new in shapes:
        starts.append(starts[-1] + new)
    gen = torch.Generator().manual_seed(seed + 1)
    return PrefillCase(
        query=torch.randn(starts[-1], heads, head_dim, generator=gen) * query_scale,
        key_cache=base.key_cache,
        value_cache=base.value_cache,
        block_tables=base.block_tables,
        query_start_loc=torch.tensor(starts, dtype=torch.int64),
        context_lens=base.context_lens,
        scale=base.scale,
        key_scale=base.key_scale,
        value_scale=base.value_scale,
    )


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [2, 8, 12], ids=["group1", "group4", "group6"])
@pytest.mark.parametrize("head_dim", sorted(SUPPORTED_HEAD_DIMS))
def test_prefill_matches_reference(head_dim: int, heads: int, dtype: torch.dtype) -> None:
    case = make_prefill_case(head_dim=head_dim, heads=heads, dtype=dtype, seed=head_dim + heads)
    assert_matches(case.run(num_threads=1), case.reference(), dtype)


@needs_compiler
@pytest.mark.parametrize("window", [1, 15, 16, 17, 100])
def test_prefill_sliding_window(window: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        case = make_prefill_case(heads=12, dtype=dtype, seed=window)
        assert_matches(case.run(window), case.reference(window), dtype)


@needs_compiler
@pytest.mark.parametrize(
    ("query_tile", "key_tile_blocks"),
    [(1, 1), (7, 0), (16, 2), (5, 32), (64, 3)],
    ids=["q1-online1", "q7-twopass", "q16-online2", "q5-online32", "q64-online3"],
)
def test_prefill_tilings_agree(query_tile: int, key_tile_blocks: int) -> None:
    """Every query tile / key tile split (online softmax over several key tiles, and two-pass)
    gives the reference, with and without a window; large scores need the running max."""
    case = make_prefill_case(heads=8, seed=query_tile, query_scale=20.0)
    for window in (None, 40):
        got = case.run(window, query_tile=query_tile, key_tile_blocks=key_tile_blocks)
        assert_matches(got, case.reference(window), torch.float32)


@needs_compiler
def test_prefill_long_context_spans_several_default_key_tiles() -> None:
    case = make_prefill_case(heads=8, shapes=((0, 600), (517, 300), (1100, 2)), query_scale=8.0)
    for window in (None, 700):
        assert_matches(case.run(window), case.reference(window), torch.float32)


@pytest.fixture(scope="module")
def target_prefill_cases() -> list[tuple[PrefillCase, int | None, torch.Tensor]]:
    cases = []
    for dtype, head_dim, heads, window in (
        (torch.float32, 80, 12, None),
        (torch.bfloat16, 128, 8, None),
        (torch.float32, 64, 2, 17),
        (torch.bfloat16, 96, 12, 40),
        *TARGET_QUANTIZED,
    ):
        case = make_prefill_case(head_dim=head_dim, heads=heads, dtype=dtype)
        cases.append((case, window, case.reference(window)))
    return cases


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_each_build_target(
    target: str,
    threads: int,
    target_prefill_cases: list[tuple[PrefillCase, int | None, torch.Tensor]],
) -> None:
    for case, window, want in target_prefill_cases:
        got = case.run(window, num_threads=threads, target=target)
        assert_matches(got, want, case.key_cache.dtype)


@needs_compiler
def test_prefill_selected_sequences_only_and_strided_rows() -> None:
    case = make_prefill_case(heads=8, shapes=((0, 17), (16, 5), (3, 30)))
    wide = torch.full((case.query.shape[0], 10, 64), NAN)
    wide[:, 1:9] = case.query
    out = torch.full((case.query.shape[0], 8, 64), NAN)
    got = paged_prefill_attention(
        wide[:, 1:9], case.key_cache, case.value_cache, case.block_tables, case.query_start_loc,
        case.context_lens, case.scale, out=out, seq_indices=torch.tensor([2, 0]),
    )  # fmt: skip
    assert got is out
    want = case.reference()
    assert_matches(out[:17], want[:17], torch.float32)
    assert_matches(out[22:], want[22:], torch.float32)
    assert out[17:22].isnan().all(), "wrote the rows of a sequence it was not given"


@needs_compiler
def test_prefill_rejects_bad_inputs() -> None:
    case = make_prefill_case(shapes=((0, 5), (16, 24)))
    with pytest.raises(ValueError, match="out of range"):
        case.run(seq_indices=torch.tensor([2]))
    short = case.context_lens.clone()
    short[1] = 20  # 24 new rows cannot fit in 20 positions
    with pytest.raises(ValueError, match="shorter than its new rows"):
        paged_prefill_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables,
            case.query_start_loc, short, case.scale,
        )  # fmt: skip
    bad_table = case.block_tables.clone()
    bad_table[1, 2] = NUM_BLOCKS
    with pytest.raises(ValueError, match="outside"):
        paged_prefill_attention(
            case.query, case.key_cache, case.value_cache, bad_table, case.query_start_loc,
            case.context_lens, case.scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(
            case.query, case.key_cache, case.value_cache, case.block_tables,
            case.query_start_loc[:2], case.context_lens, case.scale,
        )  # fmt: skip


# --- the K/V cache write -------------------------------------------------------------------------


def _write_case(
    cache_dtype: torch.dtype, src_dtype: torch.dtype, seed: int
) -> tuple[PagedKVCache, PagedKVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two identical NaN caches, and 600 rows (one prefill run over shuffled blocks, scattered
    decode slots, some slot -1) as strided views with rounding ties and specials in them."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    caches = [
        PagedKVCache(
            num_layers=2,
            num_blocks=80,
            block_size=BLOCK,
            num_kv_heads=2,
            head_dim=64,
            dtype=cache_dtype,
            fill_value=NAN,
        )
        for _ in range(2)
    ]
    blocks = rng.sample(range(1, 80), 79)
    run = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(500)]
    singles = [b * BLOCK + rng.randrange(BLOCK) for b in blocks[-40:]]
    slots = run + singles + [-1] * 60
    rng.shuffle(slots)
    wide = torch.randn(len(slots), 3, 2, 64, generator=gen)
    wide[0, 0, 0, :6] = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e-40, float("inf"), 3e38]
    )
    wide = wide.to(src_dtype)
    return caches[0], caches[1], wide[:, 0], wide[:, 2], torch.tensor(slots)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_cache_write_matches_torch_write(target: str, threads: int) -> None:
    for cache_dtype in (torch.float32, torch.bfloat16):
        for src_dtype in (torch.float32, torch.bfloat16):
            want, got, key, value, slots = _write_case(cache_dtype, src_dtype, seed=threads)
            want.write(1, key, value, slots)
            k_cache, v_cache = got.layer(1)
            paged_cache_write(key, value, k_cache, v_cache, slots, num_threads=threads,
                              target=target)  # fmt: skip
            for name in ("key", "value"):
                a, b = getattr(want, name), getattr(got, name)
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), (name, cache_dtype)
                assert torch.equal(a.isnan(), b.isnan()), "slot -1 (or a foreign slot) written"
            written = 540 * 2 * 64  # 540 slots >= 0
            assert int((~got.key[1].isnan()).sum()) == written


def _quantized_rows(seed: int, num_rows: int, src_dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, 2, 64] rows over magnitudes 1e-30..1e30, zero rows, and rows whose codes
    fall exactly halfway between two codes of each dtype (ties: round to even)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_rows, 2, 64, generator=gen, dtype=torch.float64)
    rows *= 10.0 ** torch.randint(-30, 30, (num_rows, 2, 1), generator=gen)
    rows[1, 0] = rows[3, 0] = 0.0
    rows[2, 1, :7] = -0.0
    ties = torch.arange(-28, 29, dtype=torch.float64) / 2  # int8: 0.5 steps, scale 1
    rows[3, 0, : ties.numel()] = ties
    rows[3, 0, -1] = 127.0
    # e4m3 (scale 1: amax 448): halfway between normals and between subnormals (2^-9 apart)
    e4m3 = [1 + 2**-4, 1 + 3 * 2**-4, -(2 + 2**-3), 2**-10, 3 * 2**-10, -5 * 2**-10, 448.0]
    rows[4, 0, : len(e4m3)] = torch.tensor(e4m3, dtype=torch.float64)
    rows[4, 0, len(e4m3) :] = 0.0
    e5m2 = [1 + 2**-3, 1 + 3 * 2**-3, -(4 + 2**-1), 2**-17, 3 * 2**-17, -5 * 2**-17, 57344.0]
    rows[5, 1, : len(e5m2)] = torch.tensor(e5m2, dtype=torch.float64)
    rows[5, 1, len(e5m2) :] = 0.0
    return rows.to(src_dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", QUANTIZED, ids=QUANTIZED_IDS)
def test_quantized_cache_write_matches_kv_quant(target: str, dtype: torch.dtype) -> None:
    """Codes and scales bit for bit as ``PagedKVCache.write`` (``kv_quant.quantize``) stores
    them, from float32 and bfloat16 rows, at 1 and 2 threads; other slots stay poisoned."""
    for threads, src_dtype in ((1, torch.float32), (2, torch.bfloat16)):
        want, got, *_ = _write_case(dtype, torch.float32, seed=threads)
        rng = random.Random(threads)
        slots = rng.sample(range(80 * BLOCK), 600)
        slots[::9] = [-1] * len(slots[::9])
        wide = torch.zeros(600, 3, 2, 64, dtype=src_dtype)
        wide[:, 0] = _quantized_rows(threads, 600, src_dtype)
        wide[:, 2] = _quantized_rows(7, 600, src_dtype)
        key, value, slot_mapping = wide[:, 0], wide[:, 2], torch.tensor(slots)
        want.write(1, key, value, slot_mapping)
        k_cache, v_cache = got.layer(1)
        k_scale, v_scale = got.layer_scales(1) or (None, None)
        paged_cache_write(key, value, k_cache, v_cache, slot_mapping, key_scale=k_scale,
                          value_scale=v_scale, num_threads=threads, target=target)  # fmt: skip
        for a, b in zip(want.tensors, got.tensors, strict=True):  # codes, scales, poison: bits
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (a.dtype, src_dtype)


@needs_compiler
def test_cache_write_rejects_bad_slots_before_writing() -> None:
    _, cache, key, value, slots = _write_case(torch.float32, torch.float32, seed=0)
    slots[-1] = 80 * BLOCK  # one past the last slot
    k_cache, v_cache = cache.layer(0)
    with pytest.raises(ValueError, match="slot is out of range"):
        paged_cache_write(key, value, k_cache, v_cache, slots)
    assert cache.key.isnan().all() and cache.value.isnan().all()
    with pytest.raises(ValueError, match="one row per slot"):
        paged_cache_write(key[:3], value[:3], k_cache, v_cache, slots)


# --- the backend ---------------------------------------------------------------------------------


MIXED_SHAPES = ((16, 1), (0, 7), (40, 1), (256, 1), (20, 13), (0, 1), (99, 1), (32, 40))


def _mixed_step(
    dtype: torch.dtype,
    head_dim: int,
    seed: int,
    shapes: tuple[tuple[int, int], ...] = MIXED_SHAPES,
    device: torch.device | None = None,
) -> tuple[PagedKVCache, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step of decodes and prefills (chunks on cached prefixes) over a NaN cache whose cached
    prefixes are already written; returns the cache, metadata, query and new K/V (on
    ``device``; the same numbers on any device)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device("cpu") if device is None else device
    cache = PagedKVCache(
        num_layers=2, num_blocks=300, block_size=BLOCK, num_kv_heads=2, head_dim=head_dim,
        dtype=dtype, fill_value=NAN, device=device,
    )  # fmt: skip
    free = rng.sample(range(1, 300), 299)
    tables, slots = [], []
    for cached, new in shapes:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // BLOCK))]
        all_slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)]
        if cached:
            k, v = (torch.randn(cached, 2, head_dim, generator=gen).to(device) for _ in range(2))
            cache.write(1, k, v, torch.tensor(all_slots[:cached], device=device))
        tables.append(table)
        slots.extend(all_slots[cached:])
    md = AttentionMetadata.build(
        query_lens=[n for _, n in shapes],
        context_lens=[c + n for c, n in shapes],
        block_tables=tables,
        slot_mapping=slots,
        device=device,
    )
    num_tokens = len(slots)
    query = torch.randn(num_tokens, 8, head_dim, generator=gen).to(device)
    key = torch.randn(num_tokens, 2, head_dim, generator=gen).to(device)
    value = torch.randn(num_tokens, 2, head_dim, generator=gen).to(device)
    return cache, md, query, key, value


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The native launches the backend makes, in order: "write", "decode", "prefill"."""
    calls: list[str] = []
    for owner, name, kind in (
        (cpu_attention, "launch_write", "write"),
        (cpu_attention.DecodePlan, "run", "decode"),
        (cpu_attention, "launch_prefill", "prefill"),
    ):
        real = getattr(owner, name)

        def spy(*args: Any, _real: Any = real, _kind: str = kind, **kwargs: Any) -> Any:
            calls.append(_kind)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return calls


@needs_compiler
@pytest.mark.parametrize("native_prefill", [True, False], ids=["native", "torch-prefill"])
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_equals_torch_backend_on_a_mixed_step(
    dtype: torch.dtype, window: int | None, native_prefill: bool, launches: list[str]
) -> None:
    backend = CpuAttentionBackend(native_prefill=native_prefill)
    assert backend.is_native
    outs, caches = [], []
    for impl in (TorchAttentionBackend(), backend):
        cache, md, query, key, value = _mixed_step(dtype, 64, seed=3)
        outs.append(
            impl.forward(1, query, key, value, cache, md, scale=0.125, sliding_window=window)
        )
        caches.append(cache)
    assert launches == (["write", "decode", "prefill"] if native_prefill else ["decode"])
    want, got = outs
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for name in ("key", "value"):  # K/V written exactly as the parent writes them
        a, b = getattr(caches[0], name), getattr(caches[1], name)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@needs_compiler
@pytest.mark.parametrize("native_prefill", [True, False], ids=["native", "torch-prefill"])
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_with_softcap_equals_torch_backend(
    dtype: torch.dtype, window: int | None, native_prefill: bool, launches: list[str]
) -> None:
    outs = []
    for impl in (TorchAttentionBackend(), CpuAttentionBackend(native_prefill=native_prefill)):
        cache, md, query, key, value = _mixed_step(dtype, 64, seed=11)
        outs.append(impl.forward(1, query * 3.0, key, value, cache, md, scale=0.125,
                                 sliding_window=window, softcap=2.0))  # fmt: skip
    assert launches == (["write", "decode", "prefill"] if native_prefill else ["decode"])
    want, got = outs
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_compiler
@pytest.mark.parametrize("window", [None, 5])
def test_backend_on_a_prefill_only_step(window: int | None, launches: list[str]) -> None:
    """No decodes in the step: the prefills (full, prefix hits, chunks) still go native."""
    shapes = ((0, 33), (16, 16), (17, 3), (48, 100))
    outs, caches = [], []
    for impl in (TorchAttentionBackend(), CpuAttentionBackend()):
        cache, md, query, key, value = _mixed_step(torch.float32, 64, seed=8, shapes=shapes)
        outs.append(impl.forward(1, query, key, value, cache, md, scale=0.2, sliding_window=window))
        caches.append(cache)
    assert launches == ["write", "prefill"]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(caches[0].key.nan_to_num(7.0), caches[1].key.nan_to_num(7.0))


@needs_compiler
def test_backend_with_a_bf16_model(launches: list[str]) -> None:
    """bf16 activations and cache: a bf16 output; fp32 math inside as the parent does, but the
    whole prompt (0, 7), which takes torch's bf16 SDPA (bf16 probabilities: a bf16 ulp or two
    apart, test_bf16_whole_prompts_take_torch_sdpa)."""
    outs = []
    for impl in (TorchAttentionBackend(), CpuAttentionBackend()):
        cache, md, query, key, value = _mixed_step(torch.bfloat16, 64, seed=6)
        bf16 = (t.to(torch.bfloat16) for t in (query, key, value))
        outs.append(impl.forward(1, *bf16, cache, md, scale=0.125, sliding_window=20))
    assert launches == ["write", "decode", "prefill"]
    want, got = outs
    assert got.dtype == want.dtype == torch.bfloat16
    whole = slice(md.query_start_loc_host[1], md.query_start_loc_host[2])
    torch.testing.assert_close(got[whole], want[whole], atol=2e-2, rtol=2e-2)
    got[whole] = want[whole]
    torch.testing.assert_close(got, want)


@needs_compiler
@pytest.mark.parametrize("window", [None, 40, 10])
def test_bf16_whole_prompts_take_torch_sdpa(window: int | None, launches: list[str]) -> None:
    """In bf16, a prompt whose rows are its whole context (no window shorter than it) gets
    torch's causal SDPA in bf16 on the step's K/V rows, bit for bit (transformers' call); chunks
    on cached prefixes, decodes and prompts longer than the window stay on the kernels."""
    shapes = ((0, 33), (16, 16), (0, 1), (0, 40), (48, 20), (5, 1))
    cache, md, query, key, value = _mixed_step(torch.bfloat16, 64, seed=9, shapes=shapes)
    query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))
    got = CpuAttentionBackend().forward(1, query, key, value, cache, md, scale=0.125,
                                        sliding_window=window)  # fmt: skip
    ref_cache, *_ = _mixed_step(torch.bfloat16, 64, seed=9, shapes=shapes)
    want = TorchAttentionBackend().forward(1, query, key, value, ref_cache, md, scale=0.125,
                                           sliding_window=window)  # fmt: skip
    starts = md.query_start_loc_host
    whole = [i for i, (cached, new) in enumerate(shapes)
             if cached == 0 and new > 1 and (window is None or window >= new)]  # fmt: skip
    assert whole == ([0, 3] if window != 10 else [])
    for i in whole:
        rows = slice(starts[i], starts[i + 1])
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            query[rows].transpose(0, 1)[None], key[rows].transpose(0, 1)[None],
            value[rows].transpose(0, 1)[None], is_causal=True, scale=0.125, enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
        assert torch.equal(got[rows], sdpa)
    # everything else: the kernels' fp32 math, as the torch backend's (bf16 output)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert launches == ["write", "decode", "prefill"]  # the chunks still go to the kernel
    assert torch.equal(cache.key.nan_to_num(7.0), ref_cache.key.nan_to_num(7.0))


@needs_compiler
@pytest.mark.parametrize("dtype", QUANTIZED, ids=QUANTIZED_IDS)
def test_backend_on_a_quantized_cache(dtype: torch.dtype, launches: list[str]) -> None:
    """float32 and bfloat16 activations over a quantized cache: the write, decodes and prefills
    on the kernels, bf16 whole prompts included (SDPA would see the unrounded rows); the cache
    bit for bit and the output as the torch backend's, which reads the same rounded values."""
    for act, window, softcap in ((torch.float32, 12, None), (torch.bfloat16, None, None),
                                 (torch.float32, None, 2.0)):  # fmt: skip
        outs, caches = [], []
        for impl in (TorchAttentionBackend(), CpuAttentionBackend()):
            cache, md, query, key, value = _mixed_step(dtype, 64, seed=13)
            query, key, value = (t.to(act) for t in (query, key, value))
            outs.append(impl.forward(1, query, key, value, cache, md, scale=0.125,
                                     sliding_window=window, softcap=softcap))  # fmt: skip
            caches.append(cache)
        assert launches == ["write", "decode", "prefill"], (act, window, softcap)
        launches.clear()
        want, got = outs
        assert got.dtype == want.dtype == act and not got.isnan().any()
        tol = 2e-5 if act == torch.float32 else 1e-2  # bf16: an output ulp apart at most
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        for a, b in zip(caches[0].tensors, caches[1].tensors, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), a.dtype


@needs_compiler
def test_backend_falls_back_per_call_for_unsupported_shapes(launches: list[str]) -> None:
    backend = CpuAttentionBackend()
    for dtype, head_dim in ((torch.float32, 8), (torch.float16, 64)):
        cache, md, query, key, value = _mixed_step(dtype, head_dim, seed=4)
        want_cache, *_ = _mixed_step(dtype, head_dim, seed=4)
        got = backend.forward(1, query, key, value, cache, md, scale=0.3)
        want = TorchAttentionBackend().forward(1, query, key, value, want_cache, md, scale=0.3)
        torch.testing.assert_close(got, want)
    assert launches == []


def test_factory_falls_back_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_warned", set())
    with structlog.testing.capture_logs() as logs:
        first = make_cpu_attention_backend()
        second = make_cpu_attention_backend()
    assert type(first) is TorchAttentionBackend and type(second) is TorchAttentionBackend
    assert not cpu_attention.is_available()
    warnings = [e for e in logs if e["event"] == "cpu_kernel_unavailable"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning", logs
    # The engine path on the fallback: one mixed step, same numbers as the torch backend.
    cache, md, query, key, value = _mixed_step(torch.float32, 64, seed=5)
    want_cache, *_ = _mixed_step(torch.float32, 64, seed=5)
    got = first.forward(1, query, key, value, cache, md, scale=0.125)
    want = TorchAttentionBackend().forward(1, query, key, value, want_cache, md, scale=0.125)
    torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="unavailable"):
        paged_decode_attention(
            query[:1], cache.key[1], cache.value[1], md.block_tables[:1], md.context_lens[:1],
            0.125,
        )  # fmt: skip


@needs_compiler
def test_runner_greedy_tokens_match_torch_backend(tmp_path: Path) -> None:
    """The engine path: ``ModelRunner`` with the kernel (tiny Mistral: head_dim 16, sliding
    window 12, GQA) generates what the torch backend generates."""
    from asyncpaged.testing.tiny_models import build_tiny_checkpoint
    from asyncpaged.worker.runner import ModelRunner
    from tests.model.driver import Driver, SimSequence

    checkpoint = build_tiny_checkpoint("mistral", tmp_path / "mistral")

    def generate(backend: TorchAttentionBackend) -> list[list[int]]:
        runner = ModelRunner(checkpoint, "float32", num_blocks=64, attn_backend=backend,
                             kv_fill_value=NAN)  # fmt: skip
        seqs = [
            SimSequence(seq_id=0, prompt=tuple(range(5, 22)), max_new_tokens=8),
            SimSequence(seq_id=1, prompt=tuple(range(30, 45)), max_new_tokens=6, start_step=1),
            SimSequence(  # chunked prefill across three steps while others decode
                seq_id=2, prompt=tuple(range(50, 90)), max_new_tokens=5, chunk_sizes=(16, 9, 15)
            ),
        ]
        Driver(runner, seed=1).run(seqs)
        return [s.output for s in seqs]

    backend = make_cpu_attention_backend()
    assert isinstance(backend, CpuAttentionBackend)
    assert generate(backend) == generate(TorchAttentionBackend())


# --- the build -----------------------------------------------------------------------------------

_TINY_SOURCE = 'extern "C" int asyncpaged_vec_bytes() { return ASYNCPAGED_VEC_BYTES; }\n'


@needs_compiler
def test_build_is_cached_keyed_and_atomic(tmp_path: Path) -> None:
    source = tmp_path / "tiny.cpp"
    source.write_text(_TINY_SOURCE)
    cache = tmp_path / "cache"
    with structlog.testing.capture_logs() as logs:
        first = cpu_build.build(source, "baseline", cache)
        again = cpu_build.build(source, "baseline", cache)
    assert first is not None and first == again and first.parent == cache
    events = [e["event"] for e in logs]
    assert events == ["cpu_kernel_compile_started", "cpu_kernel_compiled"], logs
    assert logs[1]["seconds"] >= 0 and logs[1]["path"] == str(first)
    assert sorted(p.name for p in cache.iterdir()) == [first.name], "temporary files left"
    source.write_text(_TINY_SOURCE + "// changed\n")
    assert cpu_build.build(source, "baseline", cache) != first  # the key hashes the source
    if "avx2" in cpu_build.supported_targets():
        assert cpu_build.build(source, "avx2", cache) not in (None, first)


def test_build_failure_returns_none_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found")
    monkeypatch.setattr(cpu_build, "_warned", set())
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with structlog.testing.capture_logs() as logs:
        assert cpu_build.build(source, "baseline", tmp_path / "cache") is None
        assert cpu_build.build(source, "baseline", tmp_path / "cache") is None
    warnings = [e for e in logs if e["event"] == "cpu_kernel_unavailable"]
    assert len(warnings) == 1 and "stderr" in warnings[0]
    assert list((tmp_path / "cache").iterdir()) == []


def test_target_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    best = cpu_build.supported_targets()[0]
    assert cpu_build.supported_targets()[-1] == "baseline"
    monkeypatch.delenv("ASYNCPAGED_CPU_TARGET", raising=False)
    assert cpu_build.select_target() == best
    monkeypatch.setenv("ASYNCPAGED_CPU_TARGET", "baseline")
    assert cpu_build.select_target() == "baseline"
    monkeypatch.setenv("ASYNCPAGED_CPU_TARGET", "sse9")
    with pytest.raises(ValueError, match="CPU target must be one of"):
        cpu_build.select_target()
    monkeypatch.setattr(cpu_build, "supported_targets", lambda: ("avx2", "baseline"))
    monkeypatch.setattr(cpu_build, "_warned", set())
    monkeypatch.setenv("ASYNCPAGED_CPU_TARGET", "avx512")
    with structlog.testing.capture_logs() as logs:
        assert cpu_build.select_target() == "avx2"  # refused: it would die on SIGILL
    assert [e["event"] for e in logs] == ["cpu_kernel_target_refused"]


@needs_compiler
@pytest.mark.parametrize("window", [None, 12])
def test_bf16_decodes_take_torch_sdpa_per_sequence(window: int | None, launches: list[str]) -> None:
    """With ``sdpa_bf16_decode`` a bf16 decode row gets torch's bf16 SDPA over its context
    gathered from the (NaN-poisoned, randomly tabled) cache, bit for bit: transformers' decode
    call (one query row, no mask). A sliding window keeps the kernel (transformers masks)."""
    shapes = ((16, 1), (0, 7), (40, 1), (255, 1), (33, 1), (1, 1))
    cache, md, query, key, value = _mixed_step(torch.bfloat16, 64, seed=12, shapes=shapes)
    query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))
    backend = CpuAttentionBackend(sdpa_bf16_decode=True)
    got = backend.forward(1, query, key, value, cache, md, scale=0.125, sliding_window=window)
    assert launches == (["write"] if window is None else ["write", "decode"])  # (0, 7): SDPA
    if window is not None:
        return
    starts = md.query_start_loc_host
    for i, (cached, new) in enumerate(shapes):
        if new != 1:
            continue
        ctx = cached + 1
        slots = torch.tensor([md.block_tables[i, p // BLOCK] * BLOCK + p % BLOCK
                              for p in range(ctx)])  # fmt: skip
        keys = cache.key[1].permute(0, 3, 1, 2).reshape(-1, 2, 64)[slots]  # [ctx, Hkv, D]
        values = cache.value[1].permute(0, 2, 1, 3).reshape(-1, 2, 64)[slots]
        row = starts[i]
        want = torch.nn.functional.scaled_dot_product_attention(
            query[row : row + 1].transpose(0, 1)[None], keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None], scale=0.125, enable_gqa=True,
        )[0, :, 0]  # fmt: skip
        assert not want.isnan().any()
        assert torch.equal(got[row], want), i
