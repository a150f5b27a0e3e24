"""GPT-2: learned positions, pre-LayerNorm, gelu_new, Conv1D weights (stored ``[in, out]``).

Conv1D weights are transposed once at load time into ``nn.Linear`` layout (``[out, in]``), so the
forward is plain ``F.linear``. Parameter names are the transformers ones
(``transformer.h.0.attn.c_attn.weight`` ...).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from asyncpaged.model.attention import AttentionMetadata
from asyncpaged.model.base import CausalLM, Embedding, Linear, linear
from asyncpaged.model.errors import UnsupportedModelError
from asyncpaged.model.kv_cache import PagedKVCache


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU approximation, written as transformers' NewGELUActivation writes it."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.layer_idx = layer_idx
        self.c_attn = Linear(hidden, 3 * hidden)
        self.c_proj = Linear(hidden, hidden)
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.scale = scale

    def forward(
        self, x: torch.Tensor, model: CausalLM, md: AttentionMetadata, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = linear(self.c_attn, x)  # [T, 3H]
        q, k, v = (t.view(num_tokens, self.num_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        o = model.attn_backend.forward(self.layer_idx, q, k, v, kv_cache, md, scale=self.scale)
        return linear(self.c_proj, o.reshape(num_tokens, -1))  # [T, H]


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = Linear(config.hidden_size, inner)
        self.c_proj = Linear(inner, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.c_proj, gelu_new(linear(self.c_fc, x)))  # [T, I] -> [T, H]


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self, h: torch.Tensor, model: CausalLM, md: AttentionMetadata, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), model, md, kv_cache)
        out: torch.Tensor = h + self.mlp(self.ln_2(h))
        return out


class _GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
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

    def __init__(self, config: Any) -> None:
        if getattr(config, "activation_function", "gelu_new") != "gelu_new":
            raise UnsupportedModelError(
                f"GPT-2 activation_function {config.activation_function!r} is not supported."
            )
        if getattr(config, "reorder_and_upcast_attn", False):
            raise UnsupportedModelError("GPT-2 reorder_and_upcast_attn is not supported.")
        super().__init__(
            config,
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
        )
        self.transformer = _GPT2Model(config)
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
