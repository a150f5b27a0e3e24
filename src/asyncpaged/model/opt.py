"""OPT (the PagedAttention paper's model): learned positions (offset 2), LayerNorm, ReLU.

Parameter names are the transformers ones (``model.decoder.layers.0.fc1.weight`` ...).
``do_layer_norm_before`` picks pre-LN (every size but 350m) or post-LN; ``word_embed_proj_dim`` !=
``hidden_size`` adds ``project_in`` / ``project_out`` around the decoder (opt-350m).

Tensor parallel (``TensorShard``): q/k/v and fc1 are column-parallel (``heads / N`` heads and
``ffn_dim / N`` MLP columns per rank), out_proj and fc2 row-parallel, each followed by an
all-reduce; embeddings, positions, LayerNorms, project_in/out and the LM head are replicated.
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

POSITION_OFFSET = 2  # OPT's learned positions start at row 2 (a fairseq padding legacy)

_ACTIVATIONS = {"relu": torch.relu, "gelu": torch.nn.functional.gelu}


class OPTAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, shard: TensorShard) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "enable_bias", True))
        self.num_heads = shard.split(config.num_attention_heads, "num_attention_heads")
        self.head_dim = hidden // config.num_attention_heads
        self.layer_idx, self.shard = layer_idx, shard
        self.scaling = self.head_dim**-0.5
        self.q_proj = column_parallel(hidden, hidden, shard, bias=bias)
        self.k_proj = column_parallel(hidden, hidden, shard, bias=bias)
        self.v_proj = column_parallel(hidden, hidden, shard, bias=bias)
        self.out_proj = row_parallel(hidden, hidden, shard, bias=bias)

    def forward(
        self, x: torch.Tensor, model: CausalLM, md: AttentionMetadata, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # transformers scales q after the projection and attends with scale 1.0: keep that order
        q = (linear(self.q_proj, x) * self.scaling).view(num_tokens, self.num_heads, -1)
        k = linear(self.k_proj, x).view(num_tokens, self.num_heads, -1)  # [T, Hkv=Hq, D]
        v = linear(self.v_proj, x).view(num_tokens, self.num_heads, -1)  # [T, Hkv=Hq, D]
        o = model.attn_backend.forward(self.layer_idx, q, k, v, kv_cache, md, scale=1.0)
        # o [T, Hq/N, D] -> partial [T, H] on each rank -> summed over the ranks
        return self.shard.reduce(linear(self.out_proj, o.reshape(num_tokens, -1)))  # [T, H]


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, shard: TensorShard) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.self_attn = OPTAttention(config, layer_idx, shard)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.shard = shard
        self.fc1 = column_parallel(hidden, config.ffn_dim, shard, bias=bias)
        self.fc2 = row_parallel(config.ffn_dim, hidden, shard, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.pre_ln = bool(config.do_layer_norm_before)
        if config.activation_function not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"OPT activation_function {config.activation_function!r} is not supported; "
                f"supported: {sorted(_ACTIVATIONS)}."
            )
        self.act = _ACTIVATIONS[config.activation_function]

    def forward(
        self, h: torch.Tensor, model: CausalLM, md: AttentionMetadata, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        # h [T, H]
        x = self.self_attn_layer_norm(h) if self.pre_ln else h
        h = h + self.self_attn(x, model, md, kv_cache)
        if not self.pre_ln:
            h = self.self_attn_layer_norm(h)
        x = self.final_layer_norm(h) if self.pre_ln else h
        # [T, ffn/N] -> partial [T, H] -> summed over the ranks
        h = h + self.shard.reduce(linear(self.fc2, self.act(linear(self.fc1, x))))
        if not self.pre_ln:
            h = self.final_layer_norm(h)
        return h


class OPTDecoder(nn.Module):
    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = Embedding(config.vocab_size, proj)
        self.embed_positions = Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden)
        self.project_in = Linear(proj, hidden, bias=False) if proj != hidden else None
        self.project_out = Linear(hidden, proj, bias=False) if proj != hidden else None
        has_final_ln = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False
        )
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = (
            nn.LayerNorm(hidden, elementwise_affine=affine) if has_final_ln else None
        )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, i, shard) for i in range(config.num_hidden_layers)
        )


class _OPTModel(nn.Module):
    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, shard)


class OPTForCausalLM(CausalLM):
    """transformers ``OPTForCausalLM`` checkpoints (LM head tied to the embedding by default)."""

    def __init__(self, config: Any, shard: TensorShard = SINGLE_SHARD) -> None:
        super().__init__(
            config,
            num_layers=config.num_hidden_layers,
            num_kv_heads=shard.split(config.num_attention_heads, "num_attention_heads"),
            head_dim=config.hidden_size // config.num_attention_heads,
            shard=shard,
        )
        self.model = _OPTModel(config, shard)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)

    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.model.decoder.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        dec = self.model.decoder
        h = torch.nn.functional.embedding(input_ids, dec.embed_tokens.weight)  # [T, proj]
        pos = torch.nn.functional.embedding(positions + POSITION_OFFSET, dec.embed_positions.weight)
        if dec.project_in is not None:
            h = linear(dec.project_in, h)  # [T, H]
        h = h + pos
        for layer in dec.layers:
            h = layer(h, self, attn_metadata, kv_cache)
        if dec.final_layer_norm is not None:
            h = dec.final_layer_norm(h)
        if dec.project_out is not None:
            h = linear(dec.project_out, h)  # [T, proj]
        return h
