"""An exact greedy LM head screened in bf16 (CPU fp32 models; on by default where it applies).

A greedy row only needs the argmax of its logits, and the fp32 LM head GEMM is a large share of a
decode step (32000 x 512 weights for the benchmark model). ``ScreenedLMHead`` computes screening
logits ``s = bf16(h) @ bf16(W)^T`` (half the bytes, bf16 FMA units), bounds how far each can be
from the exact logit ``l = h @ W^T``, keeps every token that could still be the argmax, and
rescores only those in fp32.

The bound. With ``u = 2^-8`` (bf16 unit roundoff) and ``g = H 2^-24 / (1 - H 2^-24)`` (fp32
summation of H terms in any order), for every token ``j``::

    |s_j - l_j| <= ((2u + u^2) + g (1 + u)^2) * sum_i |h_i||W_ji| + u / (1 - u) * |s_j|
                <= A * ||h|| * max_j ||W_j||  +  B * max_j |s_j|        =: E   (per row)

(rounding of ``h`` and ``W`` to bf16, exact bf16 products in fp32, fp32 accumulation, rounding of
the result to bf16; Cauchy-Schwarz for the sum). Hence the exact argmax ``j*`` satisfies
``s_j* >= l_j* - E >= l_k - E >= s_k - 2E`` for every ``k``: every token with
``s_j >= max(s) - 2E`` is a candidate, and ``j*`` is among them. Candidates are rescored as fp32
dot products and the lowest id among the best wins (``torch.argmax``'s tie rule). The bound is
inflated by 1% and a tiny absolute term against the rounding of the bound itself.

Exact means: the pick equals the argmax of the fp32 logits of the candidates, and the candidates
provably contain the argmax of the exact logits. Like any change of GEMM shape, two tokens whose
logits differ in the last fp32 bits may order differently than in another fp32 evaluation.
"""

from __future__ import annotations

import torch

from asyncpaged.model.packed_linear import packing_supported

SCREEN_CHUNK = 64  # scores are scanned as chunk maxima first: nonzero() over [N, V] is slow
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24


class ScreenedLMHead:
    """Greedy token ids from hidden states through a bf16 screen and an fp32 rescore.

    Invariants: ``weight`` is the model's fp32 LM head ``[V, H]`` (not copied);
    ``weight_bf16`` is its bf16 rounding; ``max_row_norm`` >= every row's 2-norm.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"expected a 2-D float32 LM head weight, got {weight.dtype} "
                             f"{tuple(weight.shape)}.")  # fmt: skip
        self.weight = weight
        self.weight_bf16 = weight.to(torch.bfloat16)
        self.max_row_norm = float(weight.double().norm(dim=1).max()) * (1 + 1e-6)
        hidden = weight.shape[1]
        u, g = BF16_UNIT_ROUNDOFF, hidden * FP32_UNIT_ROUNDOFF / (1 - hidden * FP32_UNIT_ROUNDOFF)
        self.coef_products = ((2 * u + u * u) + g * (1 + u) ** 2) * 1.01
        self.coef_output = u / (1 - u) * 1.01
        self._packed_bf16: torch.Tensor | None = None
        if weight.device.type == "cpu" and packing_supported():
            try:  # oneDNN's pre-packed bf16 weight: same products, about 20% faster
                self._packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(self.weight_bf16, 64)
            except RuntimeError:  # pragma: no cover - depends on the torch build
                self._packed_bf16 = None

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, H] fp32 -> (candidate rows [K], candidate token ids [K]), row-major."""
        scores = self._screen_logits(hidden.to(torch.bfloat16)).float()  # [N, V]
        high, low = scores.amax(dim=-1), scores.amin(dim=-1)  # (aminmax is 50x slower)
        magnitude = torch.maximum(high.abs(), low.abs())
        norms = torch.linalg.vector_norm(hidden, dim=-1)  # [N]
        bound = self.coef_products * norms * self.max_row_norm + self.coef_output * magnitude
        threshold = high - 2 * bound - 1e-30  # [N]
        return _at_least(scores, threshold, SCREEN_CHUNK)

    def _screen_logits(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        if self._packed_bf16 is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                hidden_bf16, self._packed_bf16, None, "none", [], ""
            )
            return out
        return torch.nn.functional.linear(hidden_bf16, self.weight_bf16)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] fp32 -> [N] int64, the argmax of the fp32 logits (ties: lowest id)."""
        num_rows = hidden.shape[0]
        if num_rows == 0:
            return torch.empty(0, dtype=torch.int64, device=hidden.device)
        rows, cols = self.screen(hidden)
        counts = torch.bincount(rows, minlength=num_rows)
        if bool((counts == 0).any()):  # NaN/inf hidden states: no screen
            logits = torch.nn.functional.linear(hidden, self.weight)
            return torch.argmax(logits, dim=-1)
        values = (hidden[rows] * self.weight[cols]).sum(dim=-1)  # [K] fp32 rescore
        best = torch.full((num_rows,), float("-inf"), dtype=values.dtype, device=values.device)
        best.scatter_reduce_(0, rows, values, reduce="amax")
        is_best = values == best[rows]
        vocab = self.weight.shape[0]
        token_ids = torch.full((num_rows,), vocab, dtype=torch.int64, device=hidden.device)
        token_ids.scatter_reduce_(0, rows[is_best], cols[is_best], reduce="amin")
        return token_ids


def _at_least(
    scores: torch.Tensor, threshold: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of ``scores [N, V] >= threshold[:, None]``, row-major, via chunk maxima."""
    num_rows, vocab = scores.shape
    pad = -vocab % chunk
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    chunks = scores.view(num_rows, -1, chunk)  # [N, C, chunk]
    hit_rows, hit_chunks = torch.nonzero(chunks.amax(dim=-1) >= threshold[:, None], as_tuple=True)
    inside = chunks[hit_rows, hit_chunks] >= threshold[hit_rows][:, None]  # [K', chunk]
    which, offset = torch.nonzero(inside, as_tuple=True)
    return hit_rows[which], hit_chunks[which] * chunk + offset
