"""An fp8 (e4m3fn) linear weight with per-tensor, per-channel or per-block scales:
compressed-tensors' ``float-quantized`` weights, multiplied by ``kernels.scaled_matmul``.

The codes are the checkpoint's ``float8_e4m3fn`` bytes as stored (viewed as uint8).
"""

from __future__ import annotations

import torch

from asyncpaged.kernels.scaled_matmul import ScaledLayout, scaled_matmul
from asyncpaged.model.quantized_linear import QuantizedWeight

__all__ = ["FP8Weight"]


class FP8Weight(QuantizedWeight):
    """``codes`` uint8 ``[out_features, in_features]`` of fp8 e4m3fn values and their ``layout``
    (scales and grouping; no zero points)."""

    __slots__ = ("codes", "layout")

    def __init__(self, codes: torch.Tensor, layout: ScaledLayout) -> None:
        assert layout.code == "fp8_e4m3", layout.code
        assert layout.zeros is None, "fp8 weights have no zero points"
        self.codes = codes
        self.layout = layout

    @property
    def in_features(self) -> int:
        return self.layout.in_features

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.codes.numel() + self.layout.scales.nbytes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_matmul(x, self.codes, self.layout)

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, layout: ScaledLayout) -> FP8Weight:
        """From the checkpoint's ``float8_e4m3fn`` ``[out, in]`` weight (its bytes, no copy when
        contiguous)."""
        assert weight.dtype == torch.float8_e4m3fn, weight.dtype
        return cls(weight.contiguous().view(torch.uint8), layout)
