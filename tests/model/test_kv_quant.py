"""The quantized KV cache: its rounding against float64, and blocks that move with their scales.

Rounding (``kv_quant``): per (token, KV head) scale ``amax / QMAX`` stored in bfloat16 first,
codes against that stored scale. The cache (``PagedKVCache`` with an int8 / fp8 dtype) writes
codes and scales, and copy-on-write and swap move both; its unused memory is NaN-poisoned
(codes where the dtype holds NaN, scales always), so a stray read shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncpaged.model.attention import AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.kv_cache import KVLayout, PagedKVCache, swap_in, swap_out
from asyncpaged.model.kv_quant import (
    KV_SCALE_DTYPE,
    QMAX,
    bytes_per_row,
    dequantize,
    kv_cache_torch_dtype,
    quantize,
    round_trip,
)

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
NUM_LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 8, 16


def _rows(seed: int, shape: tuple[int, ...] = (64, 3, 16)) -> torch.Tensor:
    """Rows over several magnitudes (tiny, unit, large), one all-zero row, one outlier row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x *= 10.0 ** torch.randint(-4, 4, (*shape[:-1], 1), generator=gen)
    x[0, 0] = 0.0
    x[1, 1, 3] = 500.0
    return x.float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_a_float64_reference(dtype: torch.dtype) -> None:
    x = _rows(seed=1)
    codes, scale = quantize(x, dtype)
    assert codes.dtype == dtype and scale.dtype == KV_SCALE_DTYPE
    assert codes.shape == x.shape and scale.shape == x.shape[:-1]
    qmax = QMAX[dtype]
    x64 = x.double()
    amax = x64.abs().amax(-1)
    # the stored scale is amax / QMAX rounded to bfloat16 (relative error <= 2^-8)
    exact = amax / qmax
    assert bool(((scale.double() - exact).abs() <= exact * 2**-8).all())
    s64 = scale.double()
    divisor = torch.where(s64 == 0, torch.ones_like(s64), s64)[..., None]
    scaled = (x64 / divisor).clamp(-qmax, qmax)
    want = torch.round(scaled).to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    assert torch.equal(codes.float(), want.float())
    assert bool((codes[0, 0].float() == 0).all()) and float(scale[0, 0]) == 0.0
    # dequantized: codes times the stored scale, exactly
    back = dequantize(codes, scale)
    assert torch.equal(back.double(), codes.double() * s64[..., None])
    # error bound: int8 half a step (plus the clamp's bf16 margin on a row's amax)
    if dtype == torch.int8:
        err = (back.double() - x64).abs()
        assert bool((err <= s64[..., None] * 0.5 + amax[..., None] * 2**-8).all())


def test_int8_rounds_half_to_even() -> None:
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])  # scale 1.0 exactly
    codes, scale = quantize(x, torch.int8)
    assert float(scale[0]) == 1.0
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_stable(dtype: torch.dtype) -> None:
    """Writing what a cache gives back changes nothing beyond the first rounding's error."""
    x = _rows(seed=2)
    once = round_trip(x, dtype)
    twice = round_trip(once, dtype)
    _, scale = quantize(x, dtype)
    step = scale.float()[..., None] * (1.0 if dtype == torch.int8 else 32.0)
    assert bool(((twice - once).abs() <= step).all())


def test_kv_cache_dtype_names() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert kv_cache_torch_dtype("int8", torch.float32) == torch.int8
    assert kv_cache_torch_dtype("float16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        kv_cache_torch_dtype("int4", torch.float32)
    # head_dim 64: 66 bytes per row against bfloat16's 128 (1.94x the tokens)
    assert bytes_per_row(torch.int8, 64) == 66
    assert bytes_per_row(torch.bfloat16, 64) == 128


def _cache(num_blocks: int, dtype: torch.dtype, layout: KVLayout = "runner") -> PagedKVCache:
    return PagedKVCache(
        num_layers=NUM_LAYERS, num_blocks=num_blocks, block_size=BLOCK, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, dtype=dtype, fill_value=float("nan"), layout=layout,
    )  # fmt: skip


def _read(cache: PagedKVCache, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantized [T, kv_heads, D] K and V rows of ``slots``, indexed by hand."""
    blocks = torch.tensor([s // BLOCK for s in slots])
    offsets = torch.tensor([s % BLOCK for s in slots])
    assert cache.key_scale is not None and cache.value_scale is not None
    ks = cache.key_scale[layer][blocks, :, offsets]
    vs = cache.value_scale[layer][blocks, :, offsets]
    if cache.layout == "nhd":
        k, v = cache.key[layer][blocks, offsets], cache.value[layer][blocks, offsets]
    else:
        k, v = cache.key[layer][blocks, :, :, offsets], cache.value[layer][blocks, :, offsets, :]
    return dequantize(k, ks), dequantize(v, vs)


@pytest.mark.parametrize("layout", ["runner", "nhd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_stores_codes_and_scales_and_appends_never_rescale(
    dtype: torch.dtype, layout: KVLayout
) -> None:
    cache = _cache(6, dtype, layout)
    assert cache.is_quantized and len(cache.tensors) == 4
    per_token = KV_HEADS * bytes_per_row(dtype, HEAD_DIM) * 2 * NUM_LAYERS
    assert cache.num_bytes == 6 * BLOCK * per_token
    k, v = _rows(3, (20, KV_HEADS, HEAD_DIM)), _rows(4, (20, KV_HEADS, HEAD_DIM))
    slots = [3 * BLOCK + i for i in range(16)] + [5 * BLOCK + i for i in range(4)]
    cache.write(1, k[:10], v[:10], torch.tensor(slots[:10]))
    first = _read(cache, 1, slots[:10])
    cache.write(1, k[10:] * 1000.0, v[10:] * 1000.0, torch.tensor(slots[10:]))  # louder appends
    got_k, got_v = _read(cache, 1, slots)
    assert torch.equal(got_k[:10], first[0]) and torch.equal(got_v[:10], first[1])
    assert torch.equal(got_k, round_trip(torch.cat([k[:10], k[10:] * 1000.0]), dtype))
    assert torch.equal(got_v, round_trip(torch.cat([v[:10], v[10:] * 1000.0]), dtype))
    # untouched: layer 0, and the slots nobody wrote (scales NaN)
    assert cache.key_scale is not None and bool(cache.key_scale[0].isnan().all())
    assert bool(cache.value_scale is not None and cache.value_scale[1, 5, :, 4:].isnan().all())
    assert bool(cache.key_scale[1, [0, 1, 2, 4]].isnan().all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_on_write_and_swap_move_codes_and_scales(dtype: torch.dtype) -> None:
    device, host = _cache(8, dtype), _cache(4, dtype)
    k, v = _rows(5, (32, KV_HEADS, HEAD_DIM)), _rows(6, (32, KV_HEADS, HEAD_DIM))
    slots = [2 * BLOCK + i for i in range(16)] + [6 * BLOCK + i for i in range(16)]
    for layer in range(NUM_LAYERS):
        device.write(layer, k, v, torch.tensor(slots))
    want = _read(device, 1, slots)
    device.copy_blocks([(2, 4), (6, 1)])
    moved = [4 * BLOCK + i for i in range(16)] + [1 * BLOCK + i for i in range(16)]
    got = _read(device, 1, moved)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    swap_out(device, host, [(4, 3), (1, 0)])
    target = _cache(8, dtype)
    swap_in(target, host, [(3, 7), (0, 5)])
    back = _read(target, 1, [7 * BLOCK + i for i in range(16)] + [5 * BLOCK + i for i in range(16)])
    assert torch.equal(back[0], want[0]) and torch.equal(back[1], want[1])
    for name in ("key_scale", "value_scale"):
        scales = getattr(target, name)
        assert bool(scales[:, [0, 1, 2, 3, 4, 6]].isnan().all()), name  # nothing else written


def test_swap_refuses_caches_of_different_dtypes() -> None:
    with pytest.raises(AssertionError, match="dtype"):
        swap_out(_cache(2, torch.int8), _cache(2, torch.float8_e4m3fn), [(0, 0)])


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """float64 attention of the last n of ctx positions: q [n, Hq, D], k/v [ctx, Hkv, D]."""
    n, ctx, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(n):
        pos = ctx - n + j
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            keys, values = (
                k[lo : pos + 1, h // group].double(),
                v[lo : pos + 1, h // group].double(),
            )
            scores = keys @ q[j, h].double() * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[j, h] = torch.softmax(scores, dim=0) @ values
    return out


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (None, 5.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_attention_matches_float64_on_the_dequantized_values(
    dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    """GQA (6 query heads on 2 KV heads), page-boundary decodes, chunks and a prompt in one
    step, over scattered blocks of a NaN-poisoned cache, against float64 attention over the
    values the cache gives back."""
    heads, num_blocks = 6, 40
    shapes = [(15, 1), (16, 1), (31, 1), (0, 17), (16, 16), (5, 12), (47, 1), (0, 1)]
    gen = torch.Generator().manual_seed(7)
    cache = _cache(num_blocks, dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, history, queries = [], [], [], []
    for cached, new in shapes:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // BLOCK))]
        all_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
        k = torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen) * 3.0
        v = torch.randn(ctx, KV_HEADS, HEAD_DIM, generator=gen)
        if cached:
            cache.write(1, k[:cached], v[:cached], all_slots[:cached])
        tables.append(table)
        slots.extend(all_slots[cached:].tolist())
        history.append((round_trip(k, dtype), round_trip(v, dtype)))
        queries.append(torch.randn(new, heads, HEAD_DIM, generator=gen))
        new_rows = (k[cached:], v[cached:])
        history[-1] = (*history[-1], *new_rows)  # type: ignore[assignment]
    md = AttentionMetadata.build(
        query_lens=[n for _, n in shapes], context_lens=[c + n for c, n in shapes],
        block_tables=tables, slot_mapping=slots, device=torch.device("cpu"), block_size=BLOCK,
    )  # fmt: skip
    new_k = torch.cat([h[2] for h in history])
    new_v = torch.cat([h[3] for h in history])
    scale = HEAD_DIM**-0.5
    out = TorchAttentionBackend(decode_group_size=3).forward(
        1, torch.cat(queries), new_k, new_v, cache, md, scale=scale, sliding_window=window,
        softcap=softcap,
    )  # fmt: skip
    assert not out.isnan().any()
    start = 0
    for (k, v, _, _), q in zip(history, queries, strict=True):
        want = _reference(q, k, v, scale, window, softcap)
        got = out[start : start + q.shape[0]].double()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        start += q.shape[0]


def test_a_checkpoints_kv_scales_are_logged_as_unused(tmp_path: Path) -> None:
    """vLLM's fp8 KV scales (``self_attn.k_scale`` / ``v_scale``) load as unused, said once at
    INFO: the cache scales each token and KV head by its own amax."""
    from safetensors.torch import load_file, save_file
    from structlog.testing import capture_logs

    from asyncpaged.model.loader import load_model
    from asyncpaged.testing.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama-gqa", tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    for layer in range(2):
        for name in ("k_scale", "v_scale"):
            weights[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(0.5)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with capture_logs() as logs:
        load_model(path, torch.float32, torch.device("cpu"))
    events = [e for e in logs if e["event"] == "checkpoint_kv_scales_unused"]
    assert len(events) == 1 and events[0]["num_tensors"] == 4
    assert events[0]["log_level"] == "info"
