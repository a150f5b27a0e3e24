"""Bucketed GEMM rows: a bounded set of oneDNN shapes, the same bits as unpadded GEMMs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncpaged.model import row_buckets
from asyncpaged.model.cpu_plan import LEVERS, plan_cpu
from asyncpaged.model.lever_checks import check_lever
from asyncpaged.model.lm_head import ScreenedLMHead
from asyncpaged.model.lm_head_int8 import Int8ScreenedArgmax, int8_screen_supported
from asyncpaged.model.packed_linear import (
    PACKED_ATTR,
    can_pack,
    linear,
    pack_linears,
    pack_weight,
    packed_matmul,
    packing_supported,
)
from asyncpaged.model.row_buckets import bucket_rows, bucketed
from asyncpaged.model.row_buckets import row_buckets as buckets_up_to

needs_packing = pytest.mark.skipif(not packing_supported(), reason="no oneDNN linear ops")
ROW_COUNTS = (1, 2, 3, 5, 9, 15, 16, 17, 31, 33, 100, 255, 257, 300, 1023, 1025, 1500)


def test_bucket_rows() -> None:
    assert [bucket_rows(n) for n in (0, 1, 5, 31, 32, 33, 34, 35, 64, 65, 100)] == [
        0, 1, 5, 31, 32, 34, 34, 36, 64, 68, 100,
    ]  # fmt: skip
    assert [bucket_rows(n) for n in (129, 257, 1025, 2047, 2048, 2049)] == [136, 272, 1088, 2048,
                                                                            2048, 2176]  # fmt: skip
    for n in range(1, 5000):
        b = bucket_rows(n)
        assert n <= b < n * (1 + 2.0**-row_buckets.MANTISSA_BITS) and bucket_rows(b) == b
    assert len(buckets_up_to(2048)) == 128
    assert len(buckets_up_to(256)) == 80


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_bucketed_shapes_and_values(lead: tuple[int, ...]) -> None:
    seen: list[int] = []
    weight = torch.randn(7, 4)

    def gemm(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows @ weight.T

    x = torch.randn(*lead, 4)
    out = bucketed(gemm, x)
    assert out.shape == (*lead, 7)
    torch.testing.assert_close(out, x @ weight.T, rtol=0, atol=0)
    assert seen == [bucket_rows(max(1, x.numel() // 4))]


def _spy_rows(monkeypatch: pytest.MonkeyPatch, namespace: Any, name: str) -> list[int]:
    """Record the row count of every call of ``namespace.name`` (a torch op)."""
    rows: list[int] = []
    op = getattr(namespace, name)

    def spy(x: torch.Tensor, *args: Any) -> Any:
        rows.append(int(x.shape[0]))
        return op(x, *args)

    monkeypatch.setattr(namespace, name, spy)
    return rows


@needs_packing
def test_packed_linear_bucketed_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(96, 160), torch.nn.Linear(160, 96, bias=False)]
    model = torch.nn.Sequential(*layers)
    reference = [m.weight.detach().clone() for m in layers]
    biases = [None if m.bias is None else m.bias.detach().clone() for m in layers]
    assert pack_linears(model, batch_hint=64) == 2
    raw = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in reference]
    unpadded = torch.ops.mkldnn._linear_pointwise
    rows = _spy_rows(monkeypatch, torch.ops.mkldnn, "_linear_pointwise")
    head = pack_weight(torch.randn(300, 96, generator=gen), 64)
    assert head is not None
    for n in ROW_COUNTS:
        x = torch.randn(n, 96, generator=gen)
        for layer, packed, bias in zip(layers, raw, biases, strict=True):
            assert PACKED_ATTR in layer.__dict__
            got = linear(layer, x)
            want = unpadded(x, packed, bias, "none", [], "")
            assert torch.equal(got, want), (n, layer)
            x = got
        logits = packed_matmul(x, head)
        assert torch.equal(logits, unpadded(x, head, None, "none", [], ""))
    assert len(rows) == 3 * len(ROW_COUNTS)
    assert set(rows) <= set(buckets_up_to(max(ROW_COUNTS)))


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN packs no bf16 on this CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bfloat16_linears_keep_f_linear_values(bias: bool) -> None:
    """A packed bf16 layer and head against bf16 ``F.linear`` (bucketed as the unpacked model
    runs it) on seeded random data: within one bf16 rounding of a float64 product everywhere;
    and the CPU plan's lever is on only where this CPU's packed GEMMs keep ``F.linear``'s bits
    (its exactness check at these shapes says so, and these products agree with the check),
    off where they do not. Under inference mode, as the engine runs its model: with autograd
    recording, a bias that requires grad is added after the bf16 GEMM's rounding instead of
    inside it, so packed and plain layers with a bias differ in a few rows of 100 (measured on
    Zen 4; what this test once caught, in 4 runs of 5, on an Emerald Rapids)."""
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(160, generator=gen))
    plain = torch.nn.Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    assert pack_linears(torch.nn.Sequential(layer), batch_hint=64) == 1
    head_weight = torch.randn(300, 96, generator=gen).bfloat16()
    head = pack_weight(head_weight, 64)
    assert head is not None and head.dtype == torch.bfloat16
    rows = ROW_COUNTS[:13]
    differ = []
    for n in rows:  # under inference mode, as the runner forwards
        x = torch.randn(n, 96, generator=gen).bfloat16()
        with torch.inference_mode():
            plain_head = bucketed(lambda rows: torch.nn.functional.linear(rows, head_weight), x)
            products = (
                (linear(layer, x), linear(plain, x), plain.weight, plain.bias),
                (packed_matmul(x, head), plain_head, head_weight, None),
            )
        for got, want, weight, layer_bias in products:
            exact = x.double() @ weight.detach().double().T
            if layer_bias is not None:
                exact += layer_bias.detach().double()
            torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=2**-7)
            if not torch.equal(got, want):
                differ.append(n)
    shapes = {"rows": max(rows), "in": 96, "out": 160, "bias": int(bias)}
    check = check_lever("packed_linear_bf16", shapes)
    plan = plan_cpu(dict.fromkeys(LEVERS, "auto"), hidden_size=96, intermediate_size=160,
                    vocab_size=300, max_num_batched_tokens=max(rows),
                    linear_shapes=((96, 160, bias),), cache=False,
                    dtype=torch.bfloat16)  # fmt: skip
    if check.exact:
        assert differ == [], f"the check found {check.detail!r}, these rows differ: {differ}"
    else:
        assert plan.packed_linears.enabled is False
        assert plan.packed_linears.reason == f"not exact here: {check.detail}"


@needs_packing
def test_screened_heads_bucketed(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(500, 64, generator=gen)
    head = ScreenedLMHead(weight)
    int8 = Int8ScreenedArgmax(weight, rescorer=head) if int8_screen_supported() else None
    bf16_rows = _spy_rows(monkeypatch, torch.ops.mkldnn, "_linear_pointwise")
    int8_rows: list[int] = []
    if int8 is not None:
        gemm = int8._gemm

        def spy(activations: torch.Tensor) -> torch.Tensor:
            int8_rows.append(activations.shape[0])
            out: torch.Tensor = gemm(activations)
            return out

        monkeypatch.setattr(int8, "_gemm", spy)
    for n in (1, 3, 7, 17, 40, 100, 257):
        hidden = torch.randn(n, 64, generator=gen)
        want = torch.argmax(hidden @ weight.T, dim=-1)
        assert torch.equal(head.argmax(hidden), want)
        scores = head._screen_logits(hidden.bfloat16())
        assert scores.shape == (n, 500)
        if int8 is not None:
            got = int8.argmax(hidden)
            assert got is not None and torch.equal(got, want)
            # padding changes nothing in the screen's scores (exact int32 sums)
            screen = int8._screen(hidden)
            assert screen is not None
            limit = int8.activation_limit
            quantized = (hidden.double() * screen.row_scale[:, None]).round().clamp(-limit, limit)
            unpadded = gemm((quantized + int8.zero_point).to(torch.uint8))
            assert torch.equal(screen.scores, unpadded)
    allowed = set(buckets_up_to(257))
    assert set(bf16_rows) <= allowed
    assert set(int8_rows) <= allowed
    assert row_buckets.bucket_rows(257) in bf16_rows
