"""Pre-packed oneDNN linears for the CPU path (an exact lever, on by default).

``F.linear`` re-lays the weight out for oneDNN on every call; packing each weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and calling ``torch.ops.mkldnn._linear_pointwise``
skips that. These are private torch ops, so everything falls back to ``F.linear``: when the ops
are missing, the tensors are not float32 or bfloat16 on CPU, or packing fails (oneDNN packs
bfloat16 only where the CPU converts it natively: ``can_pack``). The packed weight replaces the
plain one (``layer.weight`` becomes an empty placeholder), so weights are not held twice.

In float32 the result is the same math with a different summation order than ``F.linear`` (which
runs through MKL): not bit-identical, so the CPU plan leaves packing off for float32 models unless
forced. In bfloat16 ``F.linear`` itself runs through oneDNN and packing keeps its weight layout:
bit-identical where measured (Zen 4, AMX; under inference mode, as the runner forwards: with
autograd recording, a bias that requires grad is added after the GEMM's rounding), 2x faster per
GEMM on AMX (docs/benchmarks.md). Whether it is exact on the CPU at hand is checked there, not
assumed (``lever_checks``). On more threads oneDNN may split a large (prefill) GEMM's sums
differently for the two primitives, as ``F.linear``'s own outputs differ between 1 and 2 threads,
so the check runs at the engine's thread count.

Every oneDNN GEMM here runs with its rows padded to a bucket (``row_buckets``): oneDNN keeps one
primitive per distinct shape, and the step's token count changes every step. ``F.linear`` in
float32 runs through MKL, which keeps nothing per shape; in bf16/fp16 on CPU it runs through
oneDNN and is bucketed too.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncpaged._log import get_logger
from asyncpaged.model.lora_layers import lora_of
from asyncpaged.model.quantized_linear import QUANT_ATTR, quantized_linear
from asyncpaged.model.row_buckets import bucketed

_log = get_logger(__name__)

PACKED_ATTR = "packed_weight"
PACKED_DTYPES = (torch.float32, torch.bfloat16)  # (fp16 packs, but not bit-identically)


def packing_supported() -> bool:
    """Whether this torch build has the oneDNN linear ops."""
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch can pack ``dtype`` weights on this CPU (bfloat16 needs avx512 or
    AVX-NE-CONVERT; oneDNN's ISA cap counts)."""
    if dtype not in PACKED_DTYPES or not packing_supported():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 8)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module, batch_hint: int, keep: tuple[torch.Tensor, ...] = ()) -> int:
    """Pack every float32 or bfloat16 CPU ``nn.Linear`` of ``model`` in place; returns how many
    were packed.

    Weights in ``keep`` (the LM head, read elsewhere) and weights shared by two modules (a tied
    embedding) are left alone.
    """
    if not packing_supported():
        _log.info("packed_linears_unavailable")
        return 0
    shared = _shared_weight_ids(model) | {id(w) for w in keep}
    packable = {dtype: can_pack(dtype) for dtype in PACKED_DTYPES}
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or PACKED_ATTR in module.__dict__:
            continue
        if QUANT_ATTR in module.__dict__:  # a quantized weight: its own kernel
            continue
        weight = module.weight
        if not packable.get(weight.dtype) or weight.device.type != "cpu" or id(weight) in shared:
            continue
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        except RuntimeError as exc:  # pragma: no cover - depends on the torch build
            _log.warning("packed_linears_failed", error=str(exc))
            return count
        module.__dict__[PACKED_ATTR] = packed
        module.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        count += 1
    _log.debug("packed_linears", count=count, batch_hint=batch_hint)
    return count


def pack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """oneDNN's packed layout of a float32 or bfloat16 CPU ``[out, in]`` weight (a copy), or
    None where this torch cannot pack it; multiply with ``packed_matmul``."""
    if weight.device.type != "cpu" or not can_pack(weight.dtype):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except RuntimeError as exc:  # pragma: no cover - depends on the torch build
        _log.warning("packed_linears_failed", error=str(exc))
        return None
    return packed


def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ the packed weight's transpose -> [..., out] (no bias), rows bucketed."""

    def gemm(rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
        return out

    return bucketed(gemm, x)


def _shared_weight_ids(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for x [..., in] -> [..., out], through the packed weight when there is one
    (rows bucketed: ``row_buckets``), plus the step's LoRA products where adapters are
    attached (``lora_layers``; x [T, in] then)."""
    out = _base_linear(layer, x)
    lora = lora_of(layer)
    if lora is not None and lora.step.groups:
        return lora.add(x, out)
    return out


def _base_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    quantized = layer.__dict__.get(QUANT_ATTR)
    if quantized is not None:
        return quantized_linear(layer, quantized, x)
    packed = layer.__dict__.get(PACKED_ATTR)
    bias = layer.bias
    if packed is not None:

        def packed_gemm(rows: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                rows, packed, bias, "none", [], ""
            )
            return out

        return bucketed(packed_gemm, x)
    if runs_on_onednn(x):
        return bucketed(lambda rows: torch.nn.functional.linear(rows, layer.weight, bias), x)
    return torch.nn.functional.linear(x, layer.weight, bias)


def runs_on_onednn(x: torch.Tensor) -> bool:
    """Whether ``F.linear`` on ``x`` runs through oneDNN (one primitive per shape, kept): a
    reduced-precision CPU tensor. float32 CPU GEMMs run through MKL."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
