"""An exact LM head screened in bf16, for greedy and top-k rows (CPU fp32 models).

A greedy row only needs the argmax of its logits, a top-k row only the logits of its top k, and
the fp32 LM head GEMM is a large share of a decode step (32000 x 512 weights for the benchmark
model). ``ScreenedLMHead`` computes screening logits ``s = bf16(h) @ bf16(W)^T`` (half the bytes,
bf16 FMA units), bounds how far each can be from the fp32 logit ``L_j`` of token ``j``, keeps
every token that could still rank first (or in the top k), and rescores only those in fp32.

The bound. With ``u = 2^-8`` (bf16 unit roundoff) and ``g = H 2^-24 / (1 - H 2^-24)`` (fp32
summation of H terms in any order), for every token ``j`` and the exact logit ``l_j = h . W_j``::

    |s_j - l_j| <= ((2u + u^2) + g (1 + u)^2) * sum_i |h_i||W_ji| + u / (1 - u) * |s_j|
    |L_j - l_j| <= g * sum_i |h_i||W_ji|          (any fp32 evaluation: products, sums, any order)
    |s_j - L_j| <= A * ||h|| * max_j ||W_j||  +  B * max_j |s_j|        =: e   (per row)

(rounding of ``h`` and ``W`` to bf16, exact bf16 products in fp32, fp32 accumulation, rounding of
the result to bf16; Cauchy-Schwarz for the sum). ``A`` and ``B`` are inflated by 1%, and ``e`` by
an absolute 1e-30 (bf16 dot-product units flush subnormals).

Greedy. The fp32 argmax ``j*`` satisfies ``s_j* >= L_j* - e >= L_k - e >= s_k - 2e`` for every
``k``: every token with ``s_j >= max(s) - 2e`` is a candidate. Candidates are rescored as fp32 dot
products and the lowest id among the best wins (``torch.argmax``'s tie rule). A grammar's mask
(structured outputs) restricts ``j*`` and every ``k`` to its allowed tokens: the argument holds
unchanged with the other tokens' screening logits set to -inf before the threshold.

Top-k. Let ``t <= s_(k)`` (the k-th largest screening logit; the k-th largest of the 64-token
chunk maxima is used, which is never larger). The k tokens with ``s >= s_(k)`` have ``L >= t - e``,
so ``L_(k) >= t - e``; a token with ``s_j < t - 2e - d`` has ``L_j < t - e - d <= L_(k) - d``.
So the candidates ``s_j >= t - 2e - d`` hold every token whose fp32 logit reaches the k-th largest
(ties at the boundary included), and every other token's fp32 logit is at most a bound strictly
below ``L_(k)`` (``d``, a relative 2^-20, absorbs rounding the bounds to float32). This holds for
every fp32 evaluation of the logits at once, the full path's GEMM included.

Exact means: the pick equals the argmax (the top-k set) of the fp32 logits of the candidates, and
the candidates provably contain those of the exact logits and of any fp32 evaluation. The
candidates' values are this module's fp32 dot products (``rescore``); another fp32 evaluation (a
GEMM of another shape) may differ from them in the last bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncpaged.kernels.cpu_argmax import argmax_rows
from asyncpaged.model.packed_linear import packing_supported, runs_on_onednn
from asyncpaged.model.row_buckets import bucketed

SCREEN_CHUNK = 64  # scores are scanned as chunk maxima first: nonzero() over [N, V] is slow
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24
BOUND_SLACK = 2.0**-20  # relative: keeps "outside < k-th largest" strict after float32 rounding
_ABSOLUTE_SLACK = 1e-30  # subnormals flushed by bf16 dot-product units
RESCORE_BLOCK = 1024  # candidate rows gathered at a time (2 x 2 MB at H = 512)


@dataclass(frozen=True, slots=True, kw_only=True)
class TopKCandidates:
    """Per row, every token that an fp32 evaluation of the LM head could put in the row's top k.

    Invariants, for row ``r`` with ``k = top_k[r]`` and ``L`` the row's fp32 logits as any fp32
    evaluation computes them (fp32 products and sums, any order; not a bf16/TF32 matmul mode):

    - ``token_ids[r]`` is ascending and distinct, padded with ``vocab_size``; it has at least
      ``k`` real entries; ``logits[r]`` holds their fp32 logits (``ScreenedLMHead.rescore``),
      padded with -inf;
    - every token outside ``token_ids[r]`` has ``L_j <= outside_bound[r]``, and
      ``outside_bound[r] <`` the k-th largest of ``logits[r]``.

    So every token with ``L_j >=`` the k-th largest of ``L`` (boundary ties included) is a
    candidate, and the top k of ``logits[r]`` are the top k of the full row.
    """

    token_ids: torch.Tensor  # [N, C] int64
    logits: torch.Tensor  # [N, C] float32
    outside_bound: torch.Tensor  # [N] float32
    top_k: tuple[int, ...]  # [N]
    vocab_size: int


class ScreenedLMHead:
    """Greedy tokens and top-k candidates from hidden states through a bf16 screen.

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
        # the screen's error plus the error of any fp32 evaluation it is compared with
        self.coef_products = ((2 * u + u * u) + g * (1 + u) ** 2 + g) * 1.01
        self.coef_output = u / (1 - u) * 1.01
        self._packed_bf16: torch.Tensor | None = None
        if weight.device.type == "cpu" and packing_supported():
            try:  # oneDNN's pre-packed bf16 weight: same products, about 20% faster
                self._packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(self.weight_bf16, 64)
            except RuntimeError:  # pragma: no cover - depends on the torch build
                self._packed_bf16 = None

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def screen(
        self, hidden: torch.Tensor, mask_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, H] fp32 -> (candidate rows [K], candidate token ids [K]), row-major; with
        ``mask_bias`` [N, V] (0: allowed, -inf: not), candidates for the argmax over each row's
        allowed tokens."""
        scores, error = self._scores_and_error(hidden)  # [N, V], [N]
        scores = mask_scores(scores, mask_bias)
        chunks, chunk_max = _chunk(scores, SCREEN_CHUNK)
        threshold = _round_down_f32(chunk_max.amax(dim=-1).double() - 2 * error)  # [N]
        return _at_least(chunks, chunk_max, threshold)

    def argmax(self, hidden: torch.Tensor, mask_bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] fp32 -> [N] int64, the argmax of the fp32 logits (ties: lowest id).

        ``mask_bias`` [N, V] float32, 0 at a grammar's allowed tokens and -inf elsewhere
        (``structured_outputs.grammar_mask_bias``): the argmax of the logits with every other
        token at -inf, as ``sample`` takes it after the bitmask (the bound argument restricted
        to the allowed tokens: the screen's scores of the others are -inf before the threshold).
        """
        num_rows = hidden.shape[0]
        if num_rows == 0:
            return torch.empty(0, dtype=torch.int64, device=hidden.device)
        if mask_bias is not None and not allows_some(mask_bias):
            rows = torch.empty(0, dtype=torch.int64, device=hidden.device)  # a row allows none
        else:
            rows, cols = self.screen(hidden, mask_bias)
        counts = torch.bincount(rows, minlength=num_rows)
        if bool((counts == 0).any()):  # NaN/inf hidden states, no allowed token: no screen
            logits = torch.nn.functional.linear(hidden, self.weight)
            if mask_bias is not None:  # as the sampler masks: -inf, whatever the logit
                logits = logits.masked_fill(mask_bias != 0, float("-inf"))
            return argmax_rows(logits)
        values = self._rescore_pairs(hidden, rows, cols)  # [K] fp32
        best = torch.full((num_rows,), float("-inf"), dtype=values.dtype, device=values.device)
        best.scatter_reduce_(0, rows, values, reduce="amax")
        is_best = values == best[rows]
        vocab = self.weight.shape[0]
        token_ids = torch.full((num_rows,), vocab, dtype=torch.int64, device=hidden.device)
        token_ids.scatter_reduce_(0, rows[is_best], cols[is_best], reduce="amin")
        return token_ids

    def topk_candidates(self, hidden: torch.Tensor, top_k: Sequence[int]) -> TopKCandidates | None:
        """hidden [N, H] fp32 and k per row (1 for greedy) -> the rows' top-k candidates.

        See ``TopKCandidates`` for what is guaranteed and the module docstring for why. None when
        the screen cannot certify a row (NaN/inf hidden states or logits): use the full head.
        Cost: the bf16 screen plus one fp32 dot product per candidate (about 200 per row at
        k = 50 on the benchmark model, 6 at k = 1).
        """
        assert hidden.dtype == torch.float32, f"expected float32 hidden states, got {hidden.dtype}"
        num_rows, vocab = hidden.shape[0], self.vocab_size
        assert len(top_k) == num_rows, f"{len(top_k)} top-k values for {num_rows} rows"
        assert all(1 <= k <= vocab for k in top_k), f"top-k outside 1..{vocab}: {top_k}"
        ks = tuple(int(k) for k in top_k)
        if num_rows == 0:
            return TopKCandidates(
                token_ids=torch.empty(0, 0, dtype=torch.int64, device=hidden.device),
                logits=torch.empty(0, 0, dtype=torch.float32, device=hidden.device),
                outside_bound=torch.empty(0, dtype=torch.float32, device=hidden.device),
                top_k=ks,
                vocab_size=vocab,
            )
        scores, error = self._scores_and_error(hidden)  # [N, V] float32, [N] float64
        chunks, chunk_max = _chunk(scores, SCREEN_CHUNK)  # [N, B, chunk], [N, B]
        # t <= s_(k): the k largest chunk maxima are k distinct scores
        source = chunk_max if max(ks) <= chunk_max.shape[1] else scores
        index = torch.tensor(ks, dtype=torch.int64, device=hidden.device)[:, None] - 1
        kth = source.topk(max(ks), dim=-1).values.gather(1, index)[:, 0].double()  # [N]
        slack = BOUND_SLACK * (kth.abs() + error) + _ABSOLUTE_SLACK
        threshold = _round_down_f32(kth - 2 * error - slack)  # [N]
        if not bool(torch.isfinite(threshold).all()):
            return None
        rows, cols = _at_least(chunks, chunk_max, threshold)
        outside = threshold.double() + error
        outside_bound = _round_up_f32(outside + 2.0**-40 * outside.abs())  # [N]
        counts = torch.bincount(rows, minlength=num_rows)  # >= k per row
        slots = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]
        width = int(counts.max())
        token_ids = torch.full((num_rows, width), vocab, dtype=torch.int64, device=hidden.device)
        token_ids[rows, slots] = cols  # [N, C], ascending per row
        values = self._rescore_pairs(hidden, rows, cols)  # [K]
        if not bool(torch.isfinite(values).all()):
            return None  # fp32 overflow: the error bounds above do not hold
        logits = torch.full((num_rows, width), float("-inf"), device=hidden.device)
        logits[rows, slots] = values
        return TopKCandidates(
            token_ids=token_ids,
            logits=logits,
            outside_bound=outside_bound,
            top_k=ks,
            vocab_size=vocab,
        )

    def rescore(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] fp32, token_ids [N, C] -> fp32 logits [N, C], as candidates get them.

        One fp32 product per (token, hidden unit), then a sum over the hidden units: each value
        depends on its own row and token only, never on which other tokens are scored with it.
        """
        num_rows, width = token_ids.shape
        rows = torch.arange(num_rows, device=token_ids.device).repeat_interleave(width)
        return self._rescore_pairs(hidden, rows, token_ids.flatten()).view(num_rows, width)

    def _rescore_pairs(
        self, hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor:
        """fp32 logits [K] of the pairs (rows[i], cols[i]), in blocks that stay in cache."""
        values = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, rows.shape[0], RESCORE_BLOCK):
            block = slice(start, start + RESCORE_BLOCK)
            products = self.weight.index_select(0, cols[block])  # [B, H]
            products.mul_(hidden.index_select(0, rows[block]))
            values[block] = products.sum(dim=-1)
        return values

    def _scores_and_error(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Screening logits [N, V] float32 and ``e`` [N] float64: |s_j - L_j| <= e per row."""
        scores = self._screen_logits(hidden.to(torch.bfloat16)).float()  # [N, V]
        high, low = scores.amax(dim=-1), scores.amin(dim=-1)  # (aminmax is 50x slower)
        magnitude = torch.maximum(high.abs(), low.abs()).double()
        norms = torch.linalg.vector_norm(hidden.double(), dim=-1)  # [N]
        error = self.coef_products * norms * self.max_row_norm + self.coef_output * magnitude
        return scores, error + _ABSOLUTE_SLACK

    def _screen_logits(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        """bf16 [N, H] -> bf16 [N, V], rows bucketed (``row_buckets``: oneDNN keeps one
        primitive per shape); a row's scores do not depend on the other rows."""
        packed = self._packed_bf16
        if packed is not None:

            def gemm(rows: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                    rows, packed, None, "none", [], ""
                )
                return out

            return bucketed(gemm, hidden_bf16)
        weight = self.weight_bf16
        if runs_on_onednn(hidden_bf16):
            return bucketed(lambda rows: torch.nn.functional.linear(rows, weight), hidden_bf16)
        return torch.nn.functional.linear(hidden_bf16, weight)


def mask_scores(scores: torch.Tensor, mask_bias: torch.Tensor | None) -> torch.Tensor:
    """Finite scores [N, V] plus ``mask_bias`` [N, V] (0 / -inf): -inf at the disallowed tokens,
    the others unchanged (an addition: 10x cheaper than ``masked_fill`` with a bool mask)."""
    return scores if mask_bias is None else scores + mask_bias


def allows_some(mask_bias: torch.Tensor) -> bool:
    """Whether every row of ``mask_bias`` [N, V] allows at least one token."""
    return bool((mask_bias.amax(dim=-1) == 0).all())


def _chunk(scores: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [N, V] -> (scores as [N, B, chunk], padded with -inf; chunk maxima [N, B])."""
    num_rows, vocab = scores.shape
    pad = -vocab % chunk
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    chunks = scores.view(num_rows, -1, chunk)
    return chunks, chunks.amax(dim=-1)


def _at_least(
    chunks: torch.Tensor, chunk_max: torch.Tensor, threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of ``scores >= threshold[:, None]``, row-major, via chunk maxima."""
    chunk = chunks.shape[2]
    hit_rows, hit_chunks = torch.nonzero(chunk_max >= threshold[:, None], as_tuple=True)
    inside = chunks[hit_rows, hit_chunks] >= threshold[hit_rows][:, None]  # [K', chunk]
    which, offset = torch.nonzero(inside, as_tuple=True)
    return hit_rows[which], hit_chunks[which] * chunk + offset


def _round_down_f32(values: torch.Tensor) -> torch.Tensor:
    """float64 -> the largest float32 <= each value (-inf/NaN kept)."""
    rounded = values.float()
    lower = torch.nextafter(rounded, torch.full_like(rounded, float("-inf")))
    return torch.where(rounded.double() > values, lower, rounded)


def _round_up_f32(values: torch.Tensor) -> torch.Tensor:
    """float64 -> the smallest float32 >= each value (+inf/NaN kept)."""
    rounded = values.float()
    upper = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.double() < values, upper, rounded)
