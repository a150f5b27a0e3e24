"""GPT-2: learned positions, pre-LayerNorm, gelu_new, Conv1D weights (stored ``[in, out]``).

Conv1D weights are transposed once at load time into ``nn.Linear`` layout (``[out, in]``), so the
forward is plain ``F.linear``. Parameter names are the transformers ones
(``transformer.h.0.attn.c_attn.weight`` ...).

Tensor parallel (``TensorShard``): c_attn (fused q|k|v: each part split by heads) and the MLP's
c_fc are column-parallel, the two c_proj row-parallel, each followed by an all-reduce; embeddings,
LayerNorms and the LM head are replicated.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

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


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU approximation, written as transformers' NewGELUActivation writes it."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, shard: TensorShard) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = shard.split(config.num_attention_heads, "num_attention_heads")
        self.head_dim = hidden // config.num_attention_heads
        self.layer_idx, self.shard = layer_idx, shard
        self.c_attn = column_parallel(hidden, 3 * hidden, shard, parts=(1, 1, 1))
        self.c_proj = row_parallel(hidden, hidden, shard)
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.scale = scale

    def forward(
        self, x: torch.Tensor, model: CausalLM, md: AttentionMetadata, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = linear(self.c_attn, x)  # [T, 3H/N]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        o = model.attn_backend.forward(self.layer_idx, q, k, v, kv_cache, md, scale=self.scale)
        # o [T, Hq/N, D] -> partial [T, H] on each rank -> summed over the ranks
        return self.shard.reduce(linear(self.c_proj, o.reshape(num_tokens, -1)))  # [T, H]


class GPT2MLP(nn.Module):
    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.shard = shard
        self.c_fc = column_parallel(config.hidden_size, inner, shard)
        self.c_proj = row_parallel(inner, config.hidden_size, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, I/N] -> partial [T, H] -> summed over the ranks
        return self.shard.reduce(linear(self.c_proj, gelu_new(linear(self.c_fc, x))))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int, shard: TensorShard) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx, shard)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config, shard)

    def forward(
        self, h: torch.Tensor, model: CausalLM, md: AttentionMetadata, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), model, md, kv_cache)
        out: torch.Tensor = h + self.mlp(self.ln_2(h))
        return out


class _GPT2Model(nn.Module):
    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, shard) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(CausalLM):
    """transformers ``GPT2LMHeadModel`` checkpoints (LM head tied to ``wte``)."""

    base_model_prefix = "transformer."
    transposed_suffixes: ClassVar[tuple[str, ...]] = (
        "attn.c_attn.weight",
        "attn.c_proj.weight",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
    )
    ignored_suffixes: ClassVar[tuple[str, ...]] = (".attn.bias", ".attn.masked_bias")

    def __init__(self, config: Any, shard: TensorShard = SINGLE_SHARD) -> None:
        if getattr(config, "activation_function", "gelu_new") != "gelu_new":
            raise UnsupportedModelError(
                f"GPT-2 activation_function {config.activation_function!r} is not supported."
            )
        if getattr(config, "reorder_and_upcast_attn", False):
            raise UnsupportedModelError("GPT-2 reorder_and_upcast_attn is not supported.")
        super().__init__(
            config,
            num_layers=config.num_hidden_layers,
            num_kv_heads=shard.split(config.num_attention_heads, "num_attention_heads"),
            head_dim=config.hidden_size // config.num_attention_heads,
            shard=shard,
        )
        self.transformer = _GPT2Model(config, shard)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.transformer.wte.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        t = self.transformer
        h = torch.nn.functional.embedding(input_ids, t.wte.weight)  # [T, H]
        h = h + torch.nn.functional.embedding(positions, t.wpe.weight)
        for block in t.h:
            h = block(h, self, attn_metadata, kv_cache)
        out: torch.Tensor = t.ln_f(h)
        return out
