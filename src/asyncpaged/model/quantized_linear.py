"""Linear layers whose weight stays quantized: a :class:`QuantizedWeight` multiplies float32
activations by a matrix it keeps in its quantized layout (dequantized in registers by a native
kernel, float32 accumulation), never as a float copy of the matrix.

Implementations, one per storage: ``gguf_weight.GGUFWeight`` (GGUF blocks: Q8_0, Q4_0, Q4_K,
Q5_K, Q6_K), ``packed_int_weight.PackedIntWeight`` (compressed-tensors' int4 and int8
``pack-quantized`` weights) and ``fp8_weight.FP8Weight`` (compressed-tensors' fp8
``float-quantized`` weights). On the CPU they multiply through the native kernels
(``kernels.quant_matmul``, ``kernels.scaled_matmul``); on CUDA through the Triton kernels of
``kernels.triton_quant_matmul`` (imported only then: the CPU path never imports Triton).

The loader attaches a weight to an ``nn.Linear`` (under ``QUANT_ATTR`` in its ``__dict__``, as
``packed_linear`` attaches a packed weight) and empties its ``weight``; ``packed_linear.linear``
sends such a layer here. A token embedding kept quantized (GGUF's, which is also the LM head when
the two are tied) is a :class:`QuantizedRows`: the model looks up the rows of its tokens, and
multiplies by it as the LM head (``CausalLM.quantized_head``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
from torch import nn

__all__ = [
    "QUANT_ATTR",
    "QuantizedRows",
    "QuantizedWeight",
    "attach_quantized",
    "check_activations_device",
    "quantized_linear",
    "set_activations",
]

QUANT_ATTR = "quantized_weight"


class QuantizedWeight(ABC):
    """An ``[out_features, in_features]`` weight kept quantized.

    Invariants: ``matmul`` is ``x @ W.T`` for the float32 matrix ``W`` the format dequantizes to,
    up to float32 summation order; it never builds ``W``."""

    __slots__ = ()

    @property
    @abstractmethod
    def in_features(self) -> int: ...

    @property
    @abstractmethod
    def out_features(self) -> int: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held for the weight (codes, scales and zero points)."""

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] float32, contiguous, on the weight's device -> [M, out_features]
        float32."""

    def set_activations(self, activations: str) -> bool:
        """Multiply ``activations`` from now on if this weight can: ``"float32"`` (exact) or
        ``"int8"`` (x quantized per block, integer dot products: not exact); returns whether it
        does. ``ValueError`` where the weight cannot but must (int8 on CUDA). The base multiplies
        float32 only."""
        return activations == "float32"

    @abstractmethod
    def to(self, device: torch.device) -> QuantizedWeight:
        """The weight with its tensors on ``device`` (itself where they already are); on CUDA
        it multiplies through the Triton kernels."""


class QuantizedRows(Protocol):
    """A quantized ``[num_embeddings, embedding_dim]`` table read by rows (a token embedding)."""

    @property
    def in_features(self) -> int: ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> the rows' float32 values [T, in_features], exactly as the format
        dequantizes them (only those rows are dequantized)."""
        ...


def check_activations_device(activations: str, on_cuda: bool) -> None:
    """Activations other than float32 (``"int8"``) run through the CPU kernels only:
    ``ValueError`` for a weight that multiplies on CUDA."""
    if activations != "float32" and on_cuda:
        raise ValueError(
            f"quantized_activations={activations!r} runs on the CPU only; on CUDA quantized "
            "weights multiply float32 activations."
        )


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
    out = weight.matmul(rows.contiguous())
    if layer.bias is not None:
        out += layer.bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def set_activations(model: nn.Module, activations: str) -> int:
    """Make every quantized weight of ``model`` (its linears and a quantized LM head) that can
    multiply ``activations`` do so (``QuantizedWeight.set_activations``); the others keep
    float32. Returns how many do. ``ValueError`` for int8 with weights on CUDA."""
    weights = [
        w for m in model.modules() if isinstance(w := m.__dict__.get(QUANT_ATTR), QuantizedWeight)
    ]
    head = getattr(model, "quantized_head", None)  # CausalLM's LM head kept quantized
    if isinstance(head, QuantizedWeight):
        weights.append(head)
    return sum(weight.set_activations(activations) for weight in weights)
