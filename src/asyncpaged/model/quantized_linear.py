"""Linear layers whose weight stays quantized: GGUF blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) kept
as the file stores them and multiplied by ``kernels.quant_matmul`` (dequantized in registers,
float32 accumulation), never a float copy of the matrix.

The loader attaches a :class:`QuantizedWeight` to an ``nn.Linear`` (under ``QUANT_ATTR`` in its
``__dict__``, as ``packed_linear`` attaches a packed weight) and empties its ``weight``;
``packed_linear.linear`` sends such a layer here. The raw bytes are a view of the mapped file
(rows reordered into a copy only where the file permuted them: llama's Q and K projections).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from asyncpaged.kernels.quant_matmul import quant_matmul

__all__ = ["QUANT_ATTR", "QuantizedWeight", "attach_quantized", "quantized_linear"]

QUANT_ATTR = "quantized_weight"


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedWeight:
    """``raw`` uint8 ``[out_features, row_bytes]`` of ``qtype`` blocks; ``in_features`` values a
    row."""

    raw: torch.Tensor
    qtype: str
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.raw.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.raw.numel())

    @classmethod
    def from_rows(
        cls, rows: np.ndarray, qtype: str, in_features: int, permutation: tuple[int, ...] | None
    ) -> QuantizedWeight:
        """From a (read-only) ``uint8 [out, row_bytes]`` view; ``permutation``: row ``i`` is
        stored row ``permutation[i]`` (a copy of the reordered rows)."""
        if permutation is not None:
            rows = rows[np.asarray(permutation)]
        with warnings.catch_warnings():  # a read-only view of the mapped file: never written
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(rows)
        return cls(raw, qtype, in_features)


def attach_quantized(layer: nn.Linear, weight: QuantizedWeight) -> None:
    """Make ``layer`` multiply by ``weight``; its float ``weight`` parameter is emptied."""
    if (weight.out_features, weight.in_features) != (layer.out_features, layer.in_features):
        raise ValueError(
            f"a quantized weight of {weight.out_features}x{weight.in_features} does not fit a "
            f"linear layer of {layer.out_features}x{layer.in_features}."
        )
    layer.__dict__[QUANT_ATTR] = weight
    layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


def quantized_linear(layer: nn.Linear, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for x [..., in] -> [..., out] in x's dtype: the product in float32."""
    rows = x.reshape(-1, weight.in_features)
    if rows.dtype != torch.float32:
        rows = rows.float()
    out = quant_matmul(rows.contiguous(), weight.raw, weight.qtype, weight.in_features)
    if layer.bias is not None:
        out += layer.bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)
