"""Rotary position embeddings (RoPE) for the Llama family, with transformers' scaling variants.

Supported ``rope_type`` values: ``default``, ``linear``, ``dynamic`` (NTK, per sequence),
``llama3``, ``yarn``, and ``longrope`` (Phi-3; legacy ``su``) for families that opt in
(``allow_longrope``). Inverse frequencies are computed in float32 exactly as transformers
computes them, so a checkpoint rotates identically here and there. Layout is the "rotate half"
(GPT-NeoX) one transformers uses for these families: dimension ``i`` pairs with ``i + rot/2``.
``partial_rotary_factor`` (families that opt in: ``allow_partial``) rotates only the first
``rot = int(head_dim * factor)`` dims of each head; the rest pass through unchanged.

``dynamic`` deserves a note: transformers recomputes the frequencies from ``max(position_ids) + 1``
of each forward call. With one request per call that is the sequence's length after the step,
which is what we use per token here (the sequence's context length after this step). A prompt split
into chunks therefore rotates each chunk with its own length (as transformers would if fed the same
chunks), which differs from a one-shot prefill once the prompt exceeds max_position_embeddings.

``longrope`` has the same caveat: transformers uses ``long_factor`` for a whole forward call once
``max(position_ids) + 1`` exceeds ``original_max_position_embeddings`` (else ``short_factor``);
here each token uses the set its sequence's context length after this step selects. A prompt
prefilled in one step matches; a chunked one rotates its early chunks with the short set. Keys
already cached stay as they were rotated: transformers' Phi-3 ``generate`` instead recomputes the
whole cache with the long set when a sequence first crosses the boundary.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from asyncpaged.model.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    # [dim/2] float32
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope_inv_freqs(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short inv_freq [dim/2], long inv_freq [dim/2], attention factor), as transformers'
    ``_compute_longrope_parameters``; ``params`` carries ``original_max_position_embeddings``."""
    original_max = params["original_max_position_embeddings"]
    factors = []
    for field in ("short_factor", "long_factor"):
        values = params.get(field)
        if not isinstance(values, list | tuple) or len(values) != dim // 2:
            raise UnsupportedModelError(
                f"longrope {field} must be a list of {dim // 2} numbers (rotary dim {dim} / 2), "
                f"got {values!r}."
            )
        factors.append(torch.tensor([float(v) for v in values], dtype=torch.float32))
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
        )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (ext * base**exponents) for ext in factors)
    return short, long, float(attention_factor)


#: Legacy ``rope_scaling`` type names and the ``rope_type`` transformers maps them to.
_LEGACY_ROPE_TYPES = {"su": "longrope", "mrope": "default"}


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of ``config`` (for layers of ``layer_type``, where they differ).

    transformers 5 keeps them in ``config.rope_parameters``: one dict, or one per layer type
    (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``). Configs of transformers
    4 (and raw hub ``config.json`` files) carry ``rope_theta``, ``rope_scaling`` (with ``type`` or
    ``rope_type``), ``partial_rotary_factor`` and Gemma 3's ``rope_local_base_freq`` instead; both
    are read here, so the same checkpoint rotates identically either way.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        elif all(isinstance(v, dict) for v in params.values()):
            raise UnsupportedModelError(
                f"rope_parameters are given per layer type ({sorted(params)}), but layer type "
                f"{layer_type!r} has none."
            )
        out = dict(params)
    else:  # legacy fields
        scaling = getattr(config, "rope_scaling", None)
        out = dict(scaling) if isinstance(scaling, dict) else {}
        theta = getattr(config, "rope_theta", None)
        if layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
            out, theta = {}, config.rope_local_base_freq  # Gemma 3: local layers unscaled
        out["rope_theta"] = float(theta if theta is not None else 10000.0)
    rope_type = str(out.get("rope_type") or out.get("type") or "default")
    out["rope_type"] = _LEGACY_ROPE_TYPES.get(rope_type, rope_type)
    if "partial_rotary_factor" not in out:
        factor = getattr(config, "partial_rotary_factor", None)
        if factor is not None:
            out["partial_rotary_factor"] = float(factor)
    return out


class RotaryEmbedding:
    """cos/sin tables for a flat batch of positions; not an nn.Module (nothing to load).

    ``params`` (default: ``rope_parameters(config)``) are the RoPE parameters of the layers this
    table serves. Opt-ins of the families tested with them (others refuse these configs):
    ``allow_partial``, the family applies ``cos``/``sin`` of ``rotary_dim`` < head_dim columns
    (``apply_rotary`` does), ``allow_longrope``, the ``longrope`` type."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        device: torch.device,
        *,
        params: dict[str, Any] | None = None,
        allow_partial: bool = False,
        allow_longrope: bool = False,
    ) -> None:
        params = dict(rope_parameters(config) if params is None else params)
        self.rope_type: str = params.get("rope_type", "default")
        supported = SUPPORTED_ROPE_TYPES + (("longrope",) if allow_longrope else ())
        if self.rope_type not in supported:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported; supported: {supported}."
            )
        partial = float(params.get("partial_rotary_factor", 1.0))
        if partial != 1.0 and not allow_partial:
            raise UnsupportedModelError("partial_rotary_factor != 1.0 is not supported.")
        self.rotary_dim = int(head_dim * partial)  # the leading dims of a head that rotate
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor {partial} gives rotary dim {self.rotary_dim} of head_dim "
                f"{head_dim}; it must be even and in (0, head_dim]."
            )
        self.base: float = float(params.get("rope_theta", 10000.0))
        self.max_position_embeddings: int = config.max_position_embeddings
        if self.rope_type == "longrope":  # transformers: the config attribute has priority
            params["original_max_position_embeddings"] = (
                getattr(config, "original_max_position_embeddings", None)
                or params.get("original_max_position_embeddings")
                or self.max_position_embeddings
            )
        self.params = params
        self.attention_scaling = 1.0
        self.long_inv_freq: torch.Tensor | None = None  # [R/2] float32, longrope only
        with torch.device("cpu"):  # also when the model is being built on the meta device
            inv_freq = self._initial_inv_freq(params, self.rotary_dim)
        self.inv_freq = inv_freq.to(device)  # [R/2] float32

    def _initial_inv_freq(self, params: dict[str, Any], dim: int) -> torch.Tensor:
        inv_freq = _base_inv_freq(self.base, dim)
        if self.rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif self.rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(
                self.base, dim, params, self.max_position_embeddings
            )
        elif self.rope_type == "longrope":
            inv_freq, self.long_inv_freq, self.attention_scaling = _longrope_inv_freqs(
                self.base, dim, params, self.max_position_embeddings
            )
        return inv_freq

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        # seq_lens: [T] int64 -> [T, R/2] float32, one frequency set per token
        dim, max_pos = self.rotary_dim, self.max_position_embeddings
        factor = float(self.params["factor"])
        seq = torch.clamp(seq_lens, min=max_pos)  # int64, as transformers' tensor seq_len
        base = self.base * ((factor * seq / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # [T] f32
        # on the lengths' device: a CPU tensor does not broadcast with CUDA ones
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device)
        exponents = exponents.to(torch.float) / dim
        inv = 1.0 / (base[:, None] ** exponents[None, :])
        inv = torch.where((seq_lens > max_pos)[:, None], inv, self.inv_freq[None, :])
        return inv.to(self.inv_freq.device)

    def _longrope_inv_freq(self, long: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        # seq_lens: [T] int64 -> [T, R/2] float32: the long set where the sequence is past
        # original_max_position_embeddings after this step, the short set elsewhere
        long = self.long_inv_freq = long.to(self.inv_freq.device)
        is_long = (seq_lens > self.params["original_max_position_embeddings"])[:, None]  # [T, 1]
        return torch.where(is_long.to(long.device), long[None, :], self.inv_freq[None, :])

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (and per-token sequence lengths [T] for dynamic and longrope) ->
        cos, sin [T, R] (R = ``rotary_dim``)."""
        if self.rope_type == "dynamic":
            assert seq_lens is not None, "dynamic RoPE needs per-token sequence lengths"
            freqs = positions.float()[:, None] * self._dynamic_inv_freq(seq_lens)  # [T, R/2]
        elif self.long_inv_freq is not None:
            assert seq_lens is not None, "longrope needs per-token sequence lengths"
            inv_freq = self._longrope_inv_freq(self.long_inv_freq, seq_lens)  # [T, R/2]
            freqs = positions.float()[:, None] * inv_freq
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # x * 1.0 == x: skip two ops per step
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, R] (R <= D) -> x with its first R dims rotated and the rest
    passed through unchanged (partial rotary), [T, heads, D]."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
