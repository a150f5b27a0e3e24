"""An exact greedy LM head screened with an int8 GEMM (oneDNN, CPU fp32 models).

``ScreenedLMHead`` (``lm_head``) screens the fp32 logits with a bf16 GEMM; this module screens
them with oneDNN's u8 x s8 -> s32 GEMM (a quarter of the fp32 weight bytes, VNNI dot products),
bounds how far each screening logit can be from the fp32 logit, and rescores the few candidates
with ``ScreenedLMHead``'s own per-pair fp32 formula. It serves greedy rows only (``argmax``).

Quantisation. Weight row ``w_v`` gets the float32 scale ``a_v = max|w_v| / 127`` (at least
2^-100) and the int8 row ``p_v = clamp(round(w_v / a_v), -127, 127)``; ``ŵ_v = a_v p_v`` exactly.
Hidden row ``h`` gets the float64 factor ``c = A / max|h|`` (``c = 1`` for a zero row),
``h' = fl64(c h)`` and the integers ``q = clamp(round(h'), -A, A)``, passed as
``u8 = q + A + 1`` with zero point ``A + 1`` and activation scale 1.0: each row has its own
scale, and no scale is rounded to float32 on the way in. The screen works in units of ``c`` per
row. ``A`` (``activation_limit``) is 127 (8-bit activations) where oneDNN sums the u8 x s8
products exactly (VNNI), and 63 (7-bit) elsewhere: with every u8 at most 127 a pair of products
is at most 2 * 127 * 127 = 32258, so a kernel that adds pairs into saturating int16
(``vpmaddubsw`` on AVX2, or AVX-512 without VNNI) never saturates. ``int8_activation_limit``
checks on this CPU which of the two is exact; the bound below holds for either.

The bound. oneDNN accumulates ``acc_v = q . p_v`` in int32: exact, since
``|sum u8_i p_vi| <= 255 * 127 * H`` and ``|128 sum p_vi| <= 128 * 127 * H`` stay below 2^31 for
``H <= MAX_HIDDEN_SIZE`` (either form may be computed; ``int8_activation_limit`` checks on this
CPU that no int16 pair sum saturates). The float32 output ``s_v`` is ``acc_v a_v`` after at most
three float32 roundings (acc to float, the scale product, the product), so with ``u = 2^-24``,
``σ_v = q . ŵ_v`` and Cauchy-Schwarz, for the exact logit ``l_v = h . w_v`` and ``L_v`` any fp32
evaluation of it (``g`` as in ``lm_head``: H products and sums in any order)::

    |s_v - σ_v|      <= ((1 + u)^3 - 1) ||q|| ||ŵ_v||
    |σ_v - c l_v|    <= ||q|| ||w_v - ŵ_v||  +  ||q - c h|| ||w_v||
    ||q - c h||      <= ||h' - q|| + 2^-52 ||h'||                   (h' rounded in float64)
    |c L_v - c l_v|  <= g ||h'|| ||w_v|| (1 + 2^-52)  +  c H 2^-124  (flushed subnormals)

so ``|s_v - c L_v| <= e_v := 1.01 (α ||w_v|| + β b_v) + γ`` with, per row,
``α = ||h' - q|| + (2^-52 + g) ||h'||``, ``β = ||q||``, ``γ = c H 2^-124 + 2^-50 S`` (``S >= |s_v|``
for all v: the float64 sums ``s_v ± e_v`` below round by less) and, per token,
``b_v = ((1 + u)^3 - 1) ||ŵ_v|| + ||w_v - ŵ_v||``; the 1% covers the float64 evaluation of the
norms and of the bound. ``E = 1.01 (α max||w|| + β max b) + γ >= e_v`` for every token.

Greedy. ``c > 0`` keeps the argmax ``j*`` of ``L``, and for every ``k``
``s_j* + e_j* >= c L_j* >= c L_k >= s_k - e_k``. With ``k`` the screen's argmax,
``s_j* >= max(s) - 2E``: the tokens above that threshold (rounded down to float32; a float64
rounding up of it stays below the float32 ``s_j*``) are found through chunk maxima. Among them,
``j*`` has ``s_j* + e_j* >= s_k - e_k`` for the best ``k`` among them: only those are rescored, by
``ScreenedLMHead._rescore_pairs`` (a value that depends on its row and token only), and the lowest
id among the best wins, so the pick is ``ScreenedLMHead.argmax``'s, bit for bit. A zero row's
fp32 logits are all zero: token 0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from asyncpaged._log import get_logger
from asyncpaged.model.lm_head import (
    FP32_UNIT_ROUNDOFF,
    SCREEN_CHUNK,
    ScreenedLMHead,
    _at_least,
    _chunk,
    _round_down_f32,
    allows_some,
    mask_scores,
)
from asyncpaged.model.row_buckets import bucketed

_log = get_logger(__name__)

INT8_LIMIT = 127  # symmetric int8 range: -127..127 for weights (and 8-bit activations)
# Activation ranges, best first: 8-bit (-127..127 as u8 = q + 128; exact sums need VNNI) and
# 7-bit (-63..63 as u8 = q + 64 <= 127: a u8 x s8 pair sum fits int16, exact on any kernel).
ACTIVATION_LIMITS = (127, 63)
MAX_HIDDEN_SIZE = (2**31 - 1) // (255 * INT8_LIMIT)  # int32 accumulation stays exact
PREPACK_BATCH_HINT: int | None = 64  # oneDNN's weight layout hint (rows per GEMM)
OUTPUT_ROUNDINGS = 3  # float32 roundings after the int32 accumulation
BOUND_INFLATION = 1.01  # float64 evaluation of the norms and the bound itself
SUM_SLACK = 2.0**-50  # relative to |s|: float64 rounding of s +- e
MIN_WEIGHT_SCALE = 2.0**-100  # keeps every scale and every nonzero output a normal float32
FLOAT32_SAFE = 2.0**127  # logits bounded by half of this cannot overflow in float32
WEIGHT_BLOCK = 4096  # weight rows quantised at a time (float64 temporaries: 16 MB at H = 512)


@functools.cache
def int8_activation_limit() -> int | None:
    """The widest activation range (``ACTIVATION_LIMITS``) in which this torch build and CPU run
    oneDNN's int8 linear with exact int32 sums; None: neither (or no such op).

    Runs small GEMMs once (cached) whose u8 x s8 pair sums reach the range's largest: 8-bit
    activations overflow int16, so a kernel that saturates them (AVX2, or AVX-512 without VNNI)
    fails that check and the 7-bit one (pair sums below 2^15) is tried next; an expected
    outcome on such a CPU, logged at INFO.
    """
    if not (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.onednn, "qlinear_prepack")
        and hasattr(torch.ops.onednn, "qlinear_pointwise")
    ):
        return None
    try:
        for limit in ACTIVATION_LIMITS:
            if _accumulation_is_exact(limit):
                if limit != ACTIVATION_LIMITS[0]:
                    _log.info("int8_lm_head_narrow_activations", activation_limit=limit)
                return limit
    except RuntimeError as exc:  # pragma: no cover - depends on the torch build
        _log.warning("int8_lm_head_unavailable", error=str(exc))
        return None
    _log.warning("int8_lm_head_inexact")
    return None


def int8_screen_supported() -> bool:
    """Whether the int8 screen runs exactly here in some activation range."""
    return int8_activation_limit() is not None


@dataclass(frozen=True, slots=True)
class _Screen:
    """One batch through the int8 GEMM, in units of ``row_scale`` per row.

    Invariants: ``|scores[r, v] - row_scale[r] * L[r, v]| <= 1.01 * (activation[r] * ||w_v|| +
    levels[r] * b_v) + absolute[r]`` for every fp32 evaluation ``L`` of the logits (see the
    module docstring); ``row_scale > 0``; zero rows have ``is_zero`` set.
    """

    scores: torch.Tensor  # [N, V] float32
    activation: torch.Tensor  # [N] float64, α
    levels: torch.Tensor  # [N] float64, β = ||q||
    absolute: torch.Tensor  # [N] float64, γ
    row_scale: torch.Tensor  # [N] float64, c
    is_zero: torch.Tensor  # [N] bool


class Int8ScreenedArgmax:
    """Greedy tokens from hidden states through an int8 screen; the fp32 argmax, exactly.

    Invariants: ``weight`` is the model's finite fp32 LM head ``[V, H]`` (not copied), with
    ``H <= MAX_HIDDEN_SIZE``; ``weight_scales`` ``[V]`` are normal float32 and ``packed_weight``
    holds ``clamp(round(weight / weight_scales[:, None]), -127, 127)`` as oneDNN int8;
    ``row_norms[v] >= ||w_v||`` and ``rounding[v] >= b_v`` (module docstring) in float64, and
    the ``max_*`` attributes bound them and ``||ŵ_v||`` over all rows; ``rescorer.weight is
    weight``.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        rescorer: ScreenedLMHead | None = None,
        activation_limit: int = ACTIVATION_LIMITS[0],
    ) -> None:
        """``rescorer``: the model's ``ScreenedLMHead`` if there is one (saves its bf16 copy);
        ``activation_limit``: ``A`` of the module docstring (``int8_activation_limit()``)."""
        if activation_limit not in ACTIVATION_LIMITS:
            raise ValueError(f"activation_limit must be one of {ACTIVATION_LIMITS}.")
        self.activation_limit = activation_limit
        self.zero_point = activation_limit + 1
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"expected a 2-D float32 CPU LM head weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}.")  # fmt: skip
        vocab, hidden = weight.shape
        if not 1 <= hidden <= MAX_HIDDEN_SIZE or vocab < 1:
            raise ValueError(f"the int8 LM head needs 1 <= hidden size <= {MAX_HIDDEN_SIZE} and "
                             f"a vocabulary, got {tuple(weight.shape)}.")  # fmt: skip
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("the LM head weight has NaN or infinite entries.")
        if rescorer is not None and rescorer.weight is not weight:
            raise ValueError("rescorer must be the ScreenedLMHead of the same weight tensor.")
        self.weight = weight
        self.rescorer = rescorer if rescorer is not None else ScreenedLMHead(weight)
        u = FP32_UNIT_ROUNDOFF
        self.coef_output = (1 + u) ** OUTPUT_ROUNDINGS - 1
        self.coef_fp32 = hidden * u / (1 - hidden * u)  # g of lm_head
        self.absolute_slack = hidden * 2.0**-124
        quantized, self.weight_scales = _quantize_rows(weight)
        row_norms, quantized_norms, rounding_norms = _weight_norms(
            weight, quantized, self.weight_scales
        )  # [V] float64 each
        self.row_norms = row_norms
        self.rounding = (self.coef_output * quantized_norms + rounding_norms) * (1 + 1e-6)
        self.max_row_norm = float(row_norms.max())
        self.max_quantized_norm = float(quantized_norms.max())
        self.max_rounding = float(self.rounding.max())
        self.packed_weight: torch.Tensor = torch.ops.onednn.qlinear_prepack(
            quantized, None if PREPACK_BATCH_HINT is None else [PREPACK_BATCH_HINT, hidden]
        )
        self._zero_points = torch.zeros(vocab, dtype=torch.int32)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def argmax(
        self, hidden: torch.Tensor, mask_bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """hidden [N, H] fp32 -> [N] int64, the argmax of the fp32 logits (ties: lowest id).

        The same tokens as ``ScreenedLMHead.argmax``. ``mask_bias`` [N, V] (0 at a grammar's
        allowed tokens, -inf elsewhere) restricts each row's argmax to its allowed tokens (the
        bound argument over them: the others' screening logits are -inf). None when the
        screen cannot certify the batch (NaN/inf hidden states, logits that could overflow
        float32, a failing oneDNN call, a row with no allowed token): use another head.
        """
        assert hidden.dtype == torch.float32, f"expected float32 hidden states, got {hidden.dtype}"
        assert tuple(hidden.shape[1:]) == (self.weight.shape[1],), (
            f"hidden states {tuple(hidden.shape)} for an LM head {tuple(self.weight.shape)}"
        )
        num_rows, vocab = hidden.shape[0], self.vocab_size
        if num_rows == 0:
            return torch.empty(0, dtype=torch.int64, device=hidden.device)
        if mask_bias is not None and not allows_some(mask_bias):
            return None
        screen = self._screen(hidden)
        if screen is None:
            return None
        rows, cols = self._candidates(screen, mask_bias)
        values = self.rescorer._rescore_pairs(hidden, rows, cols)  # [K] fp32
        best = torch.full((num_rows,), float("-inf"), dtype=values.dtype, device=values.device)
        best.scatter_reduce_(0, rows, values, reduce="amax")
        is_best = values == best[rows]
        token_ids = torch.full((num_rows,), vocab, dtype=torch.int64, device=hidden.device)
        token_ids.scatter_reduce_(0, rows[is_best], cols[is_best], reduce="amin")
        if bool(screen.is_zero.any()):  # every fp32 logit is zero: the lowest (allowed) id
            lowest = 0 if mask_bias is None else torch.argmax((mask_bias == 0).byte(), dim=-1)
            token_ids = torch.where(screen.is_zero, lowest, token_ids)
        assert bool((token_ids < vocab).all()), "a row of the int8 screen kept no candidate"
        return token_ids

    def _candidates(
        self, screen: _Screen, mask_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [K], token ids [K]), row-major: every token that could be its row's argmax
        (among the tokens ``mask_bias`` allows)."""
        scores = mask_scores(screen.scores, mask_bias)
        chunks, chunk_max = _chunk(scores, SCREEN_CHUNK)  # [N, B, chunk], [N, B]
        error = self._row_error(screen)  # E [N]
        threshold = _round_down_f32(chunk_max.amax(dim=-1).double() - 2 * error)  # [N]
        threshold.masked_fill_(screen.is_zero, float("inf"))  # zero rows: no candidates
        rows, cols = _at_least(chunks, chunk_max, threshold)
        # per-token errors: keep j when s_j + e_j reaches max_k (s_k - e_k)
        values = scores[rows, cols].double()  # [K]
        token_error = self._token_error(screen, rows, cols)  # [K]
        floor = torch.full_like(error, float("-inf"))
        floor.scatter_reduce_(0, rows, values - token_error, reduce="amax")
        keep = values + token_error >= floor[rows]
        return rows[keep], cols[keep]

    def _row_error(self, screen: _Screen) -> torch.Tensor:
        """E [N] float64: at least every token's error bound in the row."""
        spread = screen.activation * self.max_row_norm + screen.levels * self.max_rounding
        return spread * BOUND_INFLATION + screen.absolute

    def _token_error(self, screen: _Screen, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """e [K] float64 of the pairs (rows[i], cols[i]): |s - c L| <= e for each."""
        spread = (
            screen.activation[rows] * self.row_norms[cols]
            + screen.levels[rows] * self.rounding[cols]
        )
        return spread * BOUND_INFLATION + screen.absolute[rows]

    def _screen(self, hidden: torch.Tensor) -> _Screen | None:
        """The int8 GEMM of a batch and the terms of its bound; None: no bound holds."""
        scaled = hidden.double()  # [N, H]
        peak = scaled.abs().amax(dim=-1)  # [N]; NaN and inf propagate
        if not bool(torch.isfinite(peak).all()):
            return None
        is_zero = peak == 0
        limit = self.activation_limit
        row_scale = torch.where(is_zero, 1.0, limit / peak)  # c
        scaled.mul_(row_scale[:, None])  # h'
        levels = scaled.round().clamp_(-limit, limit)  # q
        norms = torch.linalg.vector_norm(torch.stack([levels, scaled - levels, scaled]), dim=-1)
        level_norm, residual, scaled_norm = norms.unbind(0)  # ||q||, ||h' - q||, ||h'||
        screen_bound = level_norm * (2 * self.max_quantized_norm)  # >= |s_v|
        rescore_bound = scaled_norm / row_scale * (2 * self.max_row_norm)  # >= |L_v|, its sums
        if float(torch.maximum(screen_bound, rescore_bound).max()) >= FLOAT32_SAFE:
            return None  # an fp32 logit or a screening logit could overflow
        activations = levels.add_(self.zero_point).to(torch.uint8)  # [N, H]
        try:  # rows bucketed (row_buckets: one kept oneDNN primitive per shape)
            scores = bucketed(self._gemm, activations)  # [N, V]
        except RuntimeError as exc:
            _log.warning("int8_lm_head_failed", error=str(exc))
            return None
        return _Screen(
            scores=scores,
            activation=residual + (2.0**-52 + self.coef_fp32 * (1 + 2.0**-52)) * scaled_norm,
            levels=level_norm,
            absolute=row_scale * self.absolute_slack + SUM_SLACK * screen_bound,
            row_scale=row_scale,
            is_zero=is_zero,
        )

    def _gemm(self, activations: torch.Tensor) -> torch.Tensor:
        """u8 activations [R, H] (zero point ``A + 1``, scale 1) -> float32 scores [R, V]; a
        row's scores depend on that row only (exact int32 sums, then per-token scales)."""
        scores: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
            activations, 1.0, self.zero_point, self.packed_weight, self.weight_scales,
            self._zero_points, None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        return scores


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [V, H] -> (int8 rows [V, H], float32 scales [V]): ``round(w / scale)``, clamped."""
    peak = weight.abs().amax(dim=-1)  # [V]
    scales = (peak / INT8_LIMIT).clamp_(min=MIN_WEIGHT_SCALE)  # float32
    quantized = (weight / scales[:, None]).round_().clamp_(-INT8_LIMIT, INT8_LIMIT)
    return quantized.to(torch.int8), scales.contiguous()


def _weight_norms(
    weight: torch.Tensor, quantized: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """||w_v||, ||ŵ_v||, ||w_v - ŵ_v|| [V] in float64, each inflated by 1e-6."""
    vocab = weight.shape[0]
    norms = torch.empty(3, vocab, dtype=torch.float64)
    for start in range(0, vocab, WEIGHT_BLOCK):
        block = slice(start, start + WEIGHT_BLOCK)
        exact = weight[block].double()  # [B, H]
        dequantized = quantized[block].double().mul_(scales[block].double()[:, None])  # exact
        torch.linalg.vector_norm(exact, dim=-1, out=norms[0, block])
        torch.linalg.vector_norm(dequantized, dim=-1, out=norms[1, block])
        torch.linalg.vector_norm(exact.sub_(dequantized), dim=-1, out=norms[2, block])
    norms *= 1 + 1e-6
    row, quantized_row, rounding = norms.unbind(0)
    return row, quantized_row, rounding


def _accumulation_is_exact(limit: int = ACTIVATION_LIMITS[0]) -> bool:
    """Int8 GEMMs of several batch sizes whose u8 x s8 pair sums reach the largest of
    activation range ``limit`` (8-bit: 255 * 127 * 2 = 64770 > 2^15 per pair; 7-bit: 127 *
    127 * 2 = 32258), checked exactly; False on the first inexact one."""
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = 512, 96
    top, zero_point = 2 * limit + 1, limit + 1  # the largest u8, the zero point
    weight = torch.randint(-INT8_LIMIT, INT8_LIMIT + 1, (vocab, hidden), generator=gen)
    weight[0], weight[1] = INT8_LIMIT, -INT8_LIMIT
    weight[2, 0::2], weight[2, 1::2] = INT8_LIMIT, -INT8_LIMIT
    activations = torch.randint(0, top + 1, (64, hidden), generator=gen)
    activations[0], activations[1] = top, 1
    activations[2, 0::2], activations[2, 1::2] = top, 1
    # |expected| <= 512 * 128 * 127 < 2^24: exact in float32
    expected = ((activations - zero_point) @ weight.T).float()  # [64, V]
    packed = torch.ops.onednn.qlinear_prepack(
        weight.to(torch.int8), None if PREPACK_BATCH_HINT is None else [PREPACK_BATCH_HINT, hidden]
    )
    scales = torch.ones(vocab)
    zero_points = torch.zeros(vocab, dtype=torch.int32)
    for num_rows in (1, 3, 64):
        got = torch.ops.onednn.qlinear_pointwise(
            activations[:num_rows].to(torch.uint8), 1.0, zero_point, packed, scales,
            zero_points, None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        if not torch.equal(got, expected[:num_rows]):
            _log.debug("int8_sums_inexact", activation_limit=limit, num_rows=num_rows)
            return False
    return True
