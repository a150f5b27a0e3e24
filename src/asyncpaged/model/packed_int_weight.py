"""An int4 or int8 linear weight with grouped scales (and zero points): compressed-tensors'
``pack-quantized`` weights, multiplied by ``kernels.scaled_matmul`` on the CPU and by
``kernels.triton_quant_matmul`` on CUDA.

compressed-tensors packs the codes ``u = q + 2**(bits - 1)`` densely into int32 words, element
``i`` of a row at bits ``bits * i`` onward (little endian). int8 rows are therefore the bytes as
stored. int4 rows interleave two codes per byte (element ``2j`` in the low nibble of byte ``j``);
the kernel reads each run of 32 codes in Q4_0's order (byte ``j`` holds codes ``j`` and ``16 +
j``), so ``from_packed`` reorders the nibbles once: the same number of bytes, still 4-bit codes.
"""

from __future__ import annotations

import sys

import torch

from asyncpaged.kernels.scaled_matmul import RUN, ScaledLayout, scaled_matmul
from asyncpaged.model.quantized_linear import QuantizedWeight, check_activations_device

__all__ = ["PackedIntWeight", "unpack_int32"]


def unpack_int32(packed: torch.Tensor, num_bits: int, count: int) -> torch.Tensor:
    """The first ``count`` unsigned codes of each row of int32 ``packed`` [rows, words] as
    uint8 [rows, count] (``num_bits`` 4 or 8)."""
    assert sys.byteorder == "little", "compressed-tensors' packing is read as little-endian bytes"
    data = packed.contiguous().view(torch.uint8)
    if num_bits == 8:
        return data[:, :count]
    low, high = data & 15, data >> 4
    return torch.stack([low, high], dim=2).reshape(data.shape[0], -1)[:, :count]


class PackedIntWeight(QuantizedWeight):
    """``codes`` uint8 ``[out_features, row_bytes]`` (int8: one code a byte; int4: two, in runs
    of 32 as the kernel reads them) and their ``layout`` (scales, zeros, grouping).
    ``use_triton`` (default: ``codes`` is on CUDA) sends ``matmul`` to the Triton kernel (on CPU
    tensors only under ``TRITON_INTERPRET=1``: the tests). ``activations``: ``"float32"``
    (exact) or ``"int8"`` (``scaled_matmul``'s int8 activations, CPU only)."""

    __slots__ = ("activations", "codes", "layout", "use_triton")

    def __init__(
        self, codes: torch.Tensor, layout: ScaledLayout, *, use_triton: bool | None = None
    ) -> None:
        assert layout.code in ("int4", "int8"), layout.code
        self.codes = codes
        self.layout = layout
        self.activations = "float32"
        self.use_triton = codes.device.type == "cuda" if use_triton is None else use_triton

    @property
    def in_features(self) -> int:
        return self.layout.in_features

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def nbytes(self) -> int:
        zeros = self.layout.zeros
        return int(
            self.codes.numel() + self.layout.scales.nbytes + (0 if zeros is None else zeros.nbytes)
        )

    @property
    def num_bits(self) -> int:
        return 4 if self.layout.code == "int4" else 8

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from asyncpaged.kernels.triton_quant_matmul import triton_scaled_matmul

            return triton_scaled_matmul(x, self.codes, self.layout)
        return scaled_matmul(x, self.codes, self.layout, activations=self.activations)

    def set_activations(self, activations: str) -> bool:
        """``"int8"``: x quantized per weight group (CPU weights only: ``ValueError`` on
        CUDA)."""
        check_activations_device(activations, self.use_triton)
        self.activations = activations
        return True

    def to(self, device: torch.device) -> PackedIntWeight:
        if self.codes.device == device:
            return self
        moved = PackedIntWeight(self.codes.to(device), self.layout.to(device))
        moved.activations = self.activations
        return moved

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, num_bits: int, layout: ScaledLayout
    ) -> PackedIntWeight:
        """From compressed-tensors' ``weight_packed`` (int32 ``[out, ceil(in * bits / 32)]``);
        ``layout.code`` is ``int{num_bits}``."""
        k = layout.in_features
        if num_bits == 8:
            codes = packed.contiguous().view(torch.uint8)[:, :k].contiguous()
        else:
            runs = unpack_int32(packed, 4, k).reshape(packed.shape[0], -1, 2, RUN // 2)
            codes = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(packed.shape[0], k // 2)
        return cls(codes.contiguous(), layout)
