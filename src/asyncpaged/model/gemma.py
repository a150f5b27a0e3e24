"""Gemma 2 and Gemma 3 (text): Gemma RMSNorm, four norms per layer, softcaps, local/global layers.

Checkpoints: ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` (``Gemma3TextConfig``); parameter
names are the transformers ones. Multimodal ``Gemma3ForConditionalGeneration`` checkpoints run
their language model on text prompts (``Gemma3ForConditionalGenerationText``: the text config,
``language_model.`` weights renamed, the vision tower not loaded).

transformers fields honoured: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
``hidden_activation`` (``gelu_pytorch_tanh`` only), ``attention_bias``, ``query_pre_attn_scalar``
(attention scale ``query_pre_attn_scalar ** -0.5``), ``layer_types`` with ``sliding_window``
(key ``k`` visible to the query at ``p`` iff ``p - window < k <= p``, as transformers'
``sliding_window_overlay``), ``rope_parameters`` (one dict, or Gemma 3's one per layer type; the
legacy ``rope_theta`` / ``rope_local_base_freq`` too: ``rotary.rope_parameters``),
``attn_logit_softcapping`` (Gemma 2), ``final_logit_softcapping`` (``CausalLM.compute_logits``),
``tie_word_embeddings``. Gemma 3 adds per-head q/k norms before RoPE.

Fields that would change the math and are not implemented raise ``UnsupportedModelError`` at
build: another ``hidden_activation``, ``use_bidirectional_attention``, an unknown layer type, a
RoPE type other than default / linear / llama3 / yarn, and Gemma 3's ``attn_logit_softcapping``
(transformers 5 stores it but never applies it, so its intended math is ambiguous).

Numerics follow transformers exactly: the norm is ``norm(x.float()) * (1 + w.float())`` cast back
to x's dtype; embeddings are scaled by ``sqrt(hidden_size)`` rounded to the weights' dtype. No
fused elementwise path (``CausalLM.fused_ops`` is ignored): the torch code runs on every device.

Tensor parallel (``TensorShard``): as the Llama family (q/k/v, gate/up column-parallel; o_proj,
down_proj row-parallel then an all-reduce); norms, embeddings and the LM head replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncpaged.model.attention import AttentionMetadata
from asyncpaged.model.base import (
    SINGLE_SHARD,
    CausalLM,
    Embedding,
    Linear,
    TensorShard,
    column_parallel,
    linear,
    row_parallel,
)
from asyncpaged.model.errors import UnsupportedModelError
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.llama import LlamaAttention
from asyncpaged.model.rotary import RotaryEmbedding, rope_parameters

SLIDING, FULL = "sliding_attention", "full_attention"
_GEMMA3 = "gemma3_text"


class GemmaRMSNorm(nn.Module):
    """RMSNorm over the last dim, scaled by ``1 + weight`` (the weight is stored zero-centred)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., D]; float32 throughout, cast back at the end, as transformers' Gemma2RMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _check_config(config: Any) -> list[str]:
    """The config's layer types, after refusing every field that changes unimplemented math."""
    activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"hidden_activation {activation!r} is not supported.")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention is not supported.")
    if config.model_type == _GEMMA3 and getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(
            "attn_logit_softcapping is not supported for Gemma 3 (transformers ignores it)."
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= {SLIDING, FULL}:
        raise UnsupportedModelError(
            f"layer_types {layer_types!r} must list {config.num_hidden_layers} entries of "
            f"{SLIDING!r} / {FULL!r}."
        )
    return layer_types


#: RoPE types whose frequencies are fixed (checked against transformers' Gemma here); the
#: per-call ones (dynamic, longrope) are not verified for Gemma and are refused.
_GEMMA_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rotary(config: Any, head_dim: int, params: dict[str, Any]) -> RotaryEmbedding:
    rope_type = params.get("rope_type", "default")
    if rope_type not in _GEMMA_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported for Gemma; supported: {_GEMMA_ROPE_TYPES}."
        )
    return RotaryEmbedding(config, head_dim, torch.device("cpu"), params=params)


def _attention(
    config: Any, layer_idx: int, layer_type: str, head_dim: int, shard: TensorShard
) -> LlamaAttention:
    """Llama's attention with Gemma's scale (``query_pre_attn_scalar ** -0.5``), softcap (Gemma
    2), the layer type's window and Gemma 3's (1 + w) q/k norms."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    window = getattr(config, "sliding_window", None) if layer_type == SLIDING else None
    return LlamaAttention(
        config, layer_idx, head_dim, window, shard,
        scale=float(config.query_pre_attn_scalar) ** -0.5,
        softcap=None if softcap is None else float(softcap),
        qk_norm=GemmaRMSNorm if config.model_type == _GEMMA3 else None,
    )  # fmt: skip


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.shard = shard
        self.gate_proj = column_parallel(hidden, inter, shard, bias=False)
        self.up_proj = column_parallel(hidden, inter, shard, bias=False)
        self.down_proj = row_parallel(inter, hidden, shard, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> gelu_tanh(gate) * up [T, I/N] -> partial [T, H] -> summed over ranks."""
        gate = torch.nn.functional.gelu(linear(self.gate_proj, x), approximate="tanh")
        return self.shard.reduce(linear(self.down_proj, gate * linear(self.up_proj, x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, layer_type: str, head_dim: int, shard: TensorShard
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer_type
        self.self_attn = _attention(config, layer_idx, layer_type, head_dim, shard)
        self.mlp = GemmaMLP(config, shard)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)


class GemmaModel(nn.Module):
    def __init__(
        self, config: Any, layer_types: list[str], head_dim: int, shard: TensorShard
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, layer_types[i], head_dim, shard)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(CausalLM):
    """Gemma 2 / Gemma 3 text (transformers ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``)."""

    def __init__(self, config: Any, shard: TensorShard = SINGLE_SHARD) -> None:
        layer_types = _check_config(config)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        super().__init__(
            config,
            num_layers=config.num_hidden_layers,
            num_kv_heads=shard.kv_heads(config.num_key_value_heads),
            head_dim=head_dim,
            shard=shard,
        )
        self.model = GemmaModel(config, layer_types, head_dim, shard)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcap = None if cap is None else float(cap)
        # One table per layer type: Gemma 3 rotates local and global layers differently.
        per_type = config.model_type == _GEMMA3
        self.rotary = {
            t: _rotary(config, head_dim, rope_parameters(config, t if per_type else None))
            for t in sorted(set(layer_types))
        }
        self._embed_scales: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, H] times sqrt(hidden) rounded to their dtype (as
        transformers' ``embed_scale.to(weight.dtype)``)."""
        weight = self.model.embed_tokens.weight
        key = (weight.dtype, weight.device)
        scale = self._embed_scales.get(key)
        if scale is None:
            root = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32)
            scale = self._embed_scales[key] = root.to(device=weight.device, dtype=weight.dtype)
        return self.embed_ids(input_ids, weight) * scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        h = self._embed(input_ids)  # [T, H]
        cos_sin = {}
        for layer_type, rotary in self.rotary.items():
            if rotary.inv_freq.device != h.device:
                rotary.inv_freq = rotary.inv_freq.to(h.device)
            cos_sin[layer_type] = rotary.cos_sin(
                positions, attn_metadata.token_rope_lens, h.dtype
            )  # cos, sin [T, D]
        # Submodules' forward called directly: nn.Module.__call__ adds nothing here (no hooks).
        for layer in self.model.layers:
            assert isinstance(layer, GemmaDecoderLayer)
            x = layer.input_layernorm.forward(h)
            x = layer.self_attn.forward(x, cos_sin[layer.layer_type], self, attn_metadata, kv_cache)
            h = h + layer.post_attention_layernorm.forward(x)  # [T, H]
            x = layer.mlp.forward(layer.pre_feedforward_layernorm.forward(h))
            h = h + layer.post_feedforward_layernorm.forward(x)  # [T, H]
        out: torch.Tensor = self.model.norm.forward(h)  # [T, H]
        return out


class Gemma3ForConditionalGenerationText(GemmaForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (``Gemma3ForConditionalGeneration``,
    gemma-3-4b/12b/27b): the text config and the ``language_model`` weights, run as Gemma 3
    text; the vision tower and projector are not loaded, so prompts are text only."""

    ignored_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")  # fmt: skip
    # The hub layout (transformers 4) and the one transformers 5 uses in memory.
    checkpoint_renames = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    )

    def __init__(self, config: Any, shard: TensorShard = SINGLE_SHARD) -> None:
        super().__init__(config.get_text_config(), shard)
