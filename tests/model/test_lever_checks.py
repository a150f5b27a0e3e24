"""The levers' exactness checks: each can fail (a lever made inexact is caught, naming what
differs), each passes what is bit-identical, and results survive the cache's JSON."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncpaged.kernels import cpu_fused
from asyncpaged.model import lm_head, packed_linear
from asyncpaged.model.lever_checks import ExactnessCheck, check_lever, check_rows
from asyncpaged.model.packed_linear import can_pack, packing_supported

SHAPES = {"rows": 40, "hidden": 64, "inter": 96, "vocab": 300, "head_dim": 16}
LAYER = {"rows": 40, "in": 64, "out": 96, "bias": 1}


def _nudged(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first element one ulp up: the smallest inexactness."""
    out = t.clone()
    flat = out.view(-1)
    flat[0] = torch.nextafter(flat[0].float(), torch.tensor(float("inf"))).to(t.dtype)
    if torch.equal(out, t):  # bf16: one float32 ulp rounds back; take a bf16 one
        flat[0] = (flat[0].float() * (1 + 2**-7)).to(t.dtype)
    return out


def test_check_rows_cover_decode_and_prefill_up_to_the_limit() -> None:
    assert check_rows(40) == (1, 2, 3, 5, 8, 16, 17, 33, 40)
    assert check_rows(1) == (1,)
    assert check_rows(2048) == (1, 2, 3, 5, 8, 16, 17, 33, 64, 100, 257, 513, 1025, 2048)


@pytest.mark.skipif(not packing_supported(), reason="no oneDNN linear ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_gemm_one_ulp_off_is_caught(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed check compares the engine's packed GEMM with F.linear bit for bit: made to
    return exactly F.linear's result it passes, one ulp off in one element it fails."""
    if dtype == torch.bfloat16 and not can_pack(dtype):
        pytest.skip("oneDNN packs no bf16 on this CPU")
    probe = "packed_linear" if dtype == torch.float32 else "packed_linear_bf16"
    weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    real_pack = packed_linear.pack_linears

    def pack(model: torch.nn.Module, batch_hint: int, keep: Any = ()) -> int:
        for m in model.modules():  # remember each weight: packing empties layer.weight
            if isinstance(m, torch.nn.Linear):
                weights[id(m)] = (m.weight.detach().clone(), m.bias)
        return real_pack(model, batch_hint, keep)

    def unpacked(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, *weights[id(layer)])

    monkeypatch.setattr(packed_linear, "pack_linears", pack)
    monkeypatch.setattr(packed_linear, "linear", unpacked)
    assert check_lever(probe, LAYER).exact
    monkeypatch.setattr(packed_linear, "linear", lambda layer, x: _nudged(unpacked(layer, x)))
    check = check_lever(probe, LAYER)
    assert not check.exact
    name = "float32" if dtype == torch.float32 else "bfloat16"
    assert check.detail == (
        f"packed {name} [64 -> 96 + bias] GEMMs not bit-identical to F.linear "
        "at 9 of 9 row counts (1, 2, 3, 5, ...)"
    )


def test_the_fused_check_names_the_op_that_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused ops that are the model's torch ops pass; one op one ulp off fails, named."""

    class TorchOps:
        def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return cpu_fused.reference_rms_norm(x, weight, eps)

        def add_rms_norm(
            self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
        ) -> torch.Tensor:
            summed, normed = cpu_fused.reference_add_rms_norm(residual, x, weight, eps)
            residual.copy_(summed)
            return normed

        def rotary_(
            self, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
        ) -> None:
            q.copy_(cpu_fused.reference_rotary(q, cos, sin))
            if k is not None:
                k.copy_(cpu_fused.reference_rotary(k, cos, sin))

        def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return cpu_fused.reference_silu_mul(gate, up)

    ops = TorchOps()
    monkeypatch.setattr(cpu_fused, "fused_ops", lambda: ops)
    check = check_lever("fused", SHAPES)
    assert check == ExactnessCheck(
        True, "each fused float32 op bit-identical to torch's at 40 rows"
    )
    monkeypatch.setattr(TorchOps, "silu_mul", lambda self, g, u: _nudged(g * torch.sigmoid(g) * u))
    check = check_lever("fused", SHAPES)
    assert not check.exact
    assert "silu_mul" in check.detail
    assert "rms_norm" not in check.detail and "rotary" not in check.detail
    monkeypatch.setattr(cpu_fused, "fused_ops", lambda: None)
    assert check_lever("fused", SHAPES) == ExactnessCheck(
        False, "the native kernel library does not build here"
    )


@pytest.mark.skipif(not packing_supported(), reason="no oneDNN linear ops")
def test_a_screen_that_picks_another_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_lever("bf16_head", SHAPES).exact
    real = lm_head.ScreenedLMHead.argmax

    def off_by_one(self: Any, hidden: torch.Tensor, mask_bias: Any = None) -> torch.Tensor:
        picked: torch.Tensor = real(self, hidden, mask_bias)
        picked[-1] = (picked[-1] + 1) % SHAPES["vocab"]
        return picked

    monkeypatch.setattr(lm_head.ScreenedLMHead, "argmax", off_by_one)
    check = check_lever("bf16_head", SHAPES)
    assert check == ExactnessCheck(
        False, "the screened argmax differs from the float32 head's at 1, 3, 17 rows"
    )


def test_checks_round_trip_through_json_and_refuse_damage() -> None:
    check = ExactnessCheck(False, "why")
    assert ExactnessCheck.from_json(check.to_json()) == check
    for damaged in (None, ["yes", "why"], [True], {"exact": True}):
        with pytest.raises(ValueError, match="not an exactness check"):
            ExactnessCheck.from_json(damaged)
    with pytest.raises(ValueError, match="unknown exactness probe"):
        check_lever("faster_everything", SHAPES)
