"""Phi-3, Phi-3.5 and Phi-4-mini (transformers ``Phi3ForCausalLM``): fused qkv and gate|up.

The Llama block (RMSNorm, RoPE, GQA, SwiGLU) with two fused projections, as the checkpoints store
them: ``self_attn.qkv_proj`` ``[(Hq + 2 * Hkv) * D, H]`` (q rows, then k, then v) and
``mlp.gate_up_proj`` ``[2 * I, H]`` (gate rows, then up). No biases.

transformers fields honoured: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (if set; else hidden / heads),
``rms_norm_eps``, ``hidden_act`` (``silu`` only), ``vocab_size``, ``tie_word_embeddings``
(Phi-4-mini), ``sliding_window`` (every layer when set: key ``k`` is visible to query ``p`` iff
``p - window < k <= p``, transformers' mask), ``max_position_embeddings``,
``original_max_position_embeddings`` and ``rope_parameters`` / legacy ``rope_theta`` +
``rope_scaling`` (``default``, ``longrope``, legacy ``su``), with ``partial_rotary_factor``
(Phi-4-mini: 0.75; the leading ``int(D * factor)`` dims of each head rotate). Dropouts
(``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) do nothing at inference.
``UnsupportedModelError`` at build time: another ``hidden_act``, another RoPE type, longrope
factor lists missing or not of length rotary dim / 2, a partial factor giving an odd rotary dim.

Tensor parallelism splits the fused projections part by part (``ShardRule.parts``): a rank holds
its heads' rows of q, of k and of v, and its share of the gate rows and of the up rows.

Fused elementwise work (``CausalLM.fused_ops``, float32 or bfloat16 CPU): residual add + RMSNorm,
RoPE in place on q/k when the rotation is full (a partial one takes ``apply_rotary``), SiLU x up
(float32; bfloat16 keeps torch's).
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
    FusedElementwise,
    TensorShard,
    column_parallel,
    linear,
    row_parallel,
)
from asyncpaged.model.errors import UnsupportedModelError
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.llama import Backbone, LlamaForCausalLM, RMSNorm
from asyncpaged.model.rotary import RotaryEmbedding, apply_rotary


class Phi3Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, head_dim: int, shard: TensorShard) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = shard.split(heads, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = shard.kv_heads(kv_heads)  # (one, replicated, past the KV heads)
        self.head_dim, self.layer_idx, self.shard = head_dim, layer_idx, shard
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        width = (heads + 2 * kv_heads) * head_dim
        kv_replicas = shard.kv_replicas(kv_heads)
        self.qkv_proj = column_parallel(config.hidden_size, width, shard, bias=False,
                                        parts=(heads, kv_heads, kv_heads),
                                        replicas=(1, kv_replicas, kv_replicas))  # fmt: skip
        self.o_proj = row_parallel(heads * head_dim, config.hidden_size, shard, bias=False)
        self.scale = head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        model: CausalLM,
        md: AttentionMetadata,
        kv_cache: PagedKVCache,
        ops: FusedElementwise | None = None,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]; ``ops``: fused RoPE (full rotation only) for float32 or bfloat16
        CPU inputs."""
        num_tokens, d = x.shape[0], self.head_dim
        qkv = linear(self.qkv_proj, x)  # [T, (Hq + 2 Hkv) D]
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        # contiguous copies: the fused RoPE and the attention backends want dense rows
        q = qkv[:, :q_end].contiguous().view(num_tokens, self.num_heads, d)  # [T, Hq, D]
        k = qkv[:, q_end:k_end].contiguous().view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        v = qkv[:, k_end:].contiguous().view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        if ops is not None and cos_sin[0].shape[-1] == d:
            ops.rotary_(q, k, *cos_sin)
        else:
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        o = model.attn_backend.forward(
            self.layer_idx, q, k, v, kv_cache, md,
            scale=self.scale, sliding_window=self.sliding_window,
        )  # fmt: skip
        # [T, Hq D] -> partial [T, H] -> summed over the ranks
        return self.shard.reduce(linear(self.o_proj, o.reshape(num_tokens, -1)))


class Phi3MLP(nn.Module):
    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported.")
        full = config.intermediate_size
        self.intermediate, self.shard = shard.split(full, "intermediate_size"), shard
        self.gate_up_proj = column_parallel(config.hidden_size, 2 * full, shard, bias=False,
                                            parts=(1, 1))  # fmt: skip
        self.down_proj = row_parallel(full, config.hidden_size, shard, bias=False)

    def forward(self, x: torch.Tensor, ops: FusedElementwise | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; ``ops``: fused SiLU x up for float32 CPU inputs (bfloat16:
        torch's)."""
        gate_up = linear(self.gate_up_proj, x)  # [T, 2I]: gate | up
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]  # [T, I] views
        if ops is not None and gate.dtype == torch.float32:
            gated = ops.silu_mul(gate.contiguous(), up.contiguous())  # [T, I]
        else:
            gated = up * torch.nn.functional.silu(gate)  # transformers' order
        return self.shard.reduce(linear(self.down_proj, gated))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, head_dim: int, shard: TensorShard) -> None:
        super().__init__()
        self.self_attn = Phi3Attention(config, layer_idx, head_dim, shard)
        self.mlp = Phi3MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def ffn(self) -> Phi3MLP:
        """The feed-forward block, by the name Llama's forward calls it."""
        return self.mlp


class Phi3Model(nn.Module):
    def __init__(self, config: Any, head_dim: int, shard: TensorShard) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Phi3DecoderLayer(config, i, head_dim, shard) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini (transformers ``Phi3ForCausalLM`` checkpoints): Llama's
    forward (plain and fused) over Phi-3's layers and rotary."""

    def __init__(self, config: Any, shard: TensorShard = SINGLE_SHARD) -> None:
        super().__init__(config, shard)
        if self.rotary.long_inv_freq is not None:
            self.rope_switch_len = int(self.rotary.params["original_max_position_embeddings"])

    def _build_model(self, config: Any, head_dim: int, shard: TensorShard) -> Backbone:
        return Phi3Model(config, head_dim, shard)

    def _build_rotary(self, config: Any, head_dim: int) -> RotaryEmbedding:
        return RotaryEmbedding(
            config, head_dim, torch.device("cpu"), allow_partial=True, allow_longrope=True
        )
