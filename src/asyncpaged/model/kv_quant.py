"""Quantized KV cache values: int8 and fp8 codes with a scale per (token, KV head).

The one source of the cache's rounding: the paged cache's write (``kv_cache``), the attention
paths that read it back, and the tests' transformers reference (whose attention sees K and V
rounded exactly as the cache rounds them) all call :func:`quantize` and :func:`dequantize`.

For a row ``x`` (one token's K or V of one KV head, ``head_dim`` values)::

    scale = (amax(|x|) / QMAX)  rounded to KV_SCALE_DTYPE (bfloat16) first
    codes = int8: round_half_even(x / scale) clamped to [-127, 127]
            fp8:  (x / scale clamped to [-QMAX, QMAX]) cast to float8 (round to nearest even)
    x'    = codes.float() * scale.float()          (a scale of 0 gives codes 0, x' = 0)

QMAX is 127 (int8), 448 (fp8 e4m3, torch's ``float8_e4m3fn``) and 57344 (fp8 e5m2). The
arithmetic is float32 whatever the model's dtype. A scale per token means an append never
rescales what is already written, and fp8 keeps its full relative precision on small
activations (a per-tensor scale of 1.0 would spend e4m3's range on values that never come).

Why bfloat16 scales: 2 bytes keep a token's head at ``head_dim + 2`` bytes per K or V
(``head_dim`` 64: 66 bytes against bfloat16's 128, 1.94x the tokens), and bfloat16 has float32's
exponent range, so ``amax / 57344`` of a small e5m2 row never underflows as it would in float16.
Its coarse mantissa costs nothing: the codes are computed with the scale as stored, so only a
row's largest value can lose to the clamp, by at most 2^-8 of itself.
"""

from __future__ import annotations

from typing import Final

import torch

#: The quantized KV dtypes, by the name ``EngineConfig.kv_cache_dtype`` gives them ("fp8" is
#: e4m3, as in vLLM).
KV_QUANT_DTYPES: Final[dict[str, torch.dtype]] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: The largest code of each quantized dtype (the scale maps a row's amax onto it).
QMAX: Final[dict[torch.dtype, float]] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}
#: The dtype the scales are stored in (see the module docstring).
KV_SCALE_DTYPE: Final = torch.bfloat16


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` stores codes and scales (int8, fp8)."""
    return dtype in QMAX


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of ``EngineConfig.kv_cache_dtype`` ``name`` ("auto": the model's)."""
    if name == "auto":
        return model_dtype
    if name in KV_QUANT_DTYPES:
        return KV_QUANT_DTYPES[name]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown kv_cache_dtype {name!r}.")
    return dtype


def bytes_per_row(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one token's K (or V) of one KV head takes in a cache of ``dtype``: the values,
    and the scale where the cache is quantized."""
    scale_bytes = KV_SCALE_DTYPE.itemsize if is_quantized(dtype) else 0
    return head_dim * dtype.itemsize + scale_bytes


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [..., head_dim] -> (codes [..., head_dim] of ``dtype``, scales [...] of
    ``KV_SCALE_DTYPE``), each row on its own scale (see the module docstring)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / qmax).to(KV_SCALE_DTYPE)
    stored = scale.float()
    divisor = torch.where(stored == 0, torch.ones_like(stored), stored)
    scaled = xf / divisor[..., None]
    if dtype == torch.int8:
        codes = torch.round(scaled).clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = scaled.clamp_(-qmax, qmax).to(dtype)
    return codes, scale


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values codes [..., head_dim] with scales [...] stand for, in ``out_dtype``."""
    return (codes.float() * scale.float()[..., None]).to(out_dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` gives it back (float32): what attention reads."""
    codes, scale = quantize(x, dtype)
    return dequantize(codes, scale)


def fill_code(dtype: torch.dtype, fill_value: float) -> float:
    """The code that poisons unused memory of a quantized cache for ``fill_value`` (tests: NaN):
    the value itself where the dtype holds it, else int8's unused code -128 (its scale is
    poisoned with ``fill_value`` too, so a read of it is NaN either way)."""
    if dtype == torch.int8 and not (-128 <= fill_value <= 127):  # NaN compares False
        return -128.0
    return fill_value
