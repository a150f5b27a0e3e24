"""A GGUF-quantized linear weight: the raw rows of GGUF blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K)
as the file stores them, multiplied by ``kernels.quant_matmul`` on the CPU and by
``kernels.triton_quant_matmul`` on CUDA.

On the CPU the raw bytes are a view of the mapped file (rows reordered into a copy only where the
file permuted them: llama's Q and K projections); on CUDA they are one copy of those bytes.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from asyncpaged.kernels.quant_matmul import dequantize_rows, quant_matmul
from asyncpaged.model.quantized_linear import QuantizedWeight, check_activations_device

__all__ = ["GGUFWeight"]


class GGUFWeight(QuantizedWeight):
    """``raw`` uint8 ``[out_features, row_bytes]`` of ``qtype`` blocks; ``in_features`` values a
    row. ``use_triton`` (default: ``raw`` is on CUDA) sends ``matmul`` and ``rows`` to the
    Triton kernels (on CPU tensors only under ``TRITON_INTERPRET=1``: the tests)."""

    __slots__ = ("_in_features", "activations", "qtype", "raw", "use_triton")

    def __init__(
        self, raw: torch.Tensor, qtype: str, in_features: int, *, use_triton: bool | None = None
    ) -> None:
        self.raw = raw
        self.qtype = qtype
        self._in_features = in_features
        self.activations = "float32"  # or "int8": x quantized per block (set_activations)
        self.use_triton = raw.device.type == "cuda" if use_triton is None else use_triton

    @property
    def in_features(self) -> int:
        return self._in_features

    @property
    def out_features(self) -> int:
        return int(self.raw.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.raw.numel())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from asyncpaged.kernels.triton_quant_matmul import triton_quant_matmul

            return triton_quant_matmul(x, self.raw, self.qtype, self._in_features)
        return quant_matmul(x, self.raw, self.qtype, self._in_features,
                            activations=self.activations)  # fmt: skip

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> rows ``ids`` dequantized [T, in_features] float32 on the weight's device (a
        token embedding's lookup: only those rows, bit for bit as gguf-py dequantizes them). On
        the CPU, ids out of range raise ``IndexError`` before any block is read (on CUDA they
        fail as ``nn.functional.embedding``'s do)."""
        if self.use_triton:
            from asyncpaged.kernels.triton_quant_matmul import triton_dequantize_rows

            index = ids.reshape(-1).to(device=self.raw.device, dtype=torch.int64)
            picked = self.raw.index_select(0, index)
            return triton_dequantize_rows(picked, self.qtype, self._in_features)
        picked = self.raw.index_select(0, ids.reshape(-1).to(device="cpu", dtype=torch.int64))
        return dequantize_rows(picked, self.qtype, self._in_features)

    def set_activations(self, activations: str) -> bool:
        """``"int8"``: x quantized per weight block, llama.cpp's way (CPU weights only:
        ``ValueError`` on CUDA)."""
        check_activations_device(activations, self.use_triton)
        self.activations = activations
        return True

    def to(self, device: torch.device) -> GGUFWeight:
        if self.raw.device == device:
            return self
        moved = GGUFWeight(self.raw.to(device), self.qtype, self._in_features)
        moved.activations = self.activations
        return moved

    @classmethod
    def from_rows(
        cls, rows: np.ndarray, qtype: str, in_features: int, permutation: tuple[int, ...] | None
    ) -> GGUFWeight:
        """From a (read-only) ``uint8 [out, row_bytes]`` view; ``permutation``: row ``i`` is
        stored row ``permutation[i]`` (a copy of the reordered rows)."""
        if permutation is not None:
            rows = rows[np.asarray(permutation)]
        with warnings.catch_warnings():  # a read-only view of the mapped file: never written
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(rows)
        return cls(raw, qtype, in_features)
