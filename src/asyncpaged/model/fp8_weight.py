"""An fp8 (e4m3fn) linear weight with per-tensor, per-channel or per-block scales:
compressed-tensors' ``float-quantized`` weights, multiplied by ``kernels.scaled_matmul`` on the
CPU and by ``kernels.triton_quant_matmul`` on CUDA.

The codes are the checkpoint's ``float8_e4m3fn`` bytes as stored (viewed as uint8).
"""

from __future__ import annotations

import torch

from asyncpaged.kernels.scaled_matmul import ScaledLayout, scaled_matmul
from asyncpaged.model.quantized_linear import QuantizedWeight

__all__ = ["FP8Weight"]


class FP8Weight(QuantizedWeight):
    """``codes`` uint8 ``[out_features, in_features]`` of fp8 e4m3fn values and their ``layout``
    (scales and grouping; no zero points). ``use_triton`` (default: ``codes`` is on CUDA) sends
    ``matmul`` to the Triton kernel (on CPU tensors only under ``TRITON_INTERPRET=1``)."""

    __slots__ = ("codes", "layout", "use_triton")

    def __init__(
        self, codes: torch.Tensor, layout: ScaledLayout, *, use_triton: bool | None = None
    ) -> None:
        assert layout.code == "fp8_e4m3", layout.code
        assert layout.zeros is None, "fp8 weights have no zero points"
        self.codes = codes
        self.layout = layout
        self.use_triton = codes.device.type == "cuda" if use_triton is None else use_triton

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
        if self.use_triton:
            from asyncpaged.kernels.triton_quant_matmul import triton_scaled_matmul

            return triton_scaled_matmul(x, self.codes, self.layout)
        return scaled_matmul(x, self.codes, self.layout)

    def to(self, device: torch.device) -> FP8Weight:
        if self.codes.device == device:
            return self
        return FP8Weight(self.codes.to(device), self.layout.to(device))

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, layout: ScaledLayout) -> FP8Weight:
        """From the checkpoint's ``float8_e4m3fn`` ``[out, in]`` weight (its bytes, no copy when
        contiguous)."""
        assert weight.dtype == torch.float8_e4m3fn, weight.dtype
        return cls(weight.contiguous().view(torch.uint8), layout)
