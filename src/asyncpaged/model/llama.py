"""Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral: RMSNorm, RoPE (with scaling variants),
GQA, SwiGLU (dense, or sparse MoE blocks from ``asyncpaged.model.moe``).

Parameter names are the transformers ones (``model.layers.0.self_attn.q_proj.weight`` ...).
Differences between them: Qwen2 has q/k/v biases; Llama, Qwen3 and Qwen3-MoE may have
``attention_bias`` (all four projections; Llama also ``mlp_bias``); Qwen3 and Qwen3-MoE
RMS-norm each query and key head over ``head_dim`` (``self_attn.q_norm`` / ``k_norm``) before
RoPE; ``head_dim`` is read from the config where it has one.

Sliding windows: Mistral, Mixtral and Qwen3-MoE on every layer when ``sliding_window`` is set
(transformers' config clears it for Qwen3-MoE unless ``use_sliding_window``); Qwen2 and Qwen3 on
the layers ``layer_types`` marks ``sliding_attention`` (the config derives them from
``use_sliding_window`` and ``max_window_layers``). Qwen3-MoE and Mixtral layers carry a sparse
MoE block where ``moe.is_sparse_layer`` says so (Qwen3-MoE ``mlp_only_layers`` /
``decoder_sparse_step`` layers keep the dense MLP of ``intermediate_size``).

Tensor parallel (``TensorShard``): q/k/v and gate/up are column-parallel (a rank holds
``heads / N`` query heads, ``kv_heads / N`` KV heads and ``intermediate / N`` MLP columns);
o_proj and down_proj are row-parallel, each followed by an all-reduce. Embeddings, norms and the
LM head are replicated. MoE blocks split each expert the same way and keep the router replicated
(``moe``).

Fused elementwise work (``CausalLM.fused_ops``, set by the runner for float32 and bfloat16 CPU
models): the residual adds fused with the RMSNorm that reads each sum, RoPE on q/k in place, and
SiLU x up (float32 only), each one native call (``asyncpaged.kernels.cpu_fused``); the same math
as the torch code up to fp32 summation order (bfloat16 rounds where the torch code rounds). Any
other dtype or device takes the torch code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from asyncpaged.model.attention import AttentionMetadata
from asyncpaged.model.base import (
    FUSED_DTYPES,
    SINGLE_SHARD,
    CausalLM,
    Embedding,
    FusedElementwise,
    Linear,
    TensorShard,
    column_parallel,
    linear,
    row_parallel,
    silu_mul,
)
from asyncpaged.model.errors import UnsupportedModelError
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.moe import SparseMoeBlock, block_name, is_sparse_layer
from asyncpaged.model.rotary import RotaryEmbedding, apply_rotary

#: families whose attention RMS-norms each q/k head before RoPE
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
#: families with one sliding window on every layer / on the ``layer_types`` sliding layers
_ALL_LAYERS_WINDOW = ("mistral", "mixtral", "qwen3_moe")
_LAYER_TYPES_WINDOW = ("qwen2", "qwen3")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, H]; normalised in float32, as transformers does (no copies when x is float32)
        h = x if x.dtype == torch.float32 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


def _sliding_windows(config: Any, num_layers: int) -> list[int | None]:
    window = getattr(config, "sliding_window", None)
    if config.model_type in _ALL_LAYERS_WINDOW:
        return [window] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "qwen3" and layer_types:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"layer_types {sorted(unknown)} are not supported.")
    if config.model_type in _LAYER_TYPES_WINDOW and window is not None and layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [None] * num_layers


class LlamaAttention(nn.Module):
    """q/k/v/o projections, optional per-head q/k norms before RoPE, paged attention.

    Families built on it (Gemma) pass their own ``scale`` (default ``head_dim ** -0.5``),
    ``softcap`` (attention logit softcapping) and q/k norm class (default: RMSNorm for Qwen3
    and Qwen3-MoE, none for the rest)."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        head_dim: int,
        window: int | None,
        shard: TensorShard,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        qk_norm: Callable[[int, float], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        hidden, heads, kv_heads = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        )  # fmt: skip
        self.num_heads = shard.split(heads, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = shard.kv_heads(kv_heads)  # (one, replicated, past the KV heads)
        kv_replicas = (shard.kv_replicas(kv_heads),)
        self.head_dim, self.shard = head_dim, shard
        self.layer_idx, self.sliding_window = layer_idx, window
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.q_proj = column_parallel(hidden, heads * head_dim, shard, bias=qkv_bias)
        self.k_proj = column_parallel(hidden, kv_heads * head_dim, shard, bias=qkv_bias,
                                      replicas=kv_replicas)  # fmt: skip
        self.v_proj = column_parallel(hidden, kv_heads * head_dim, shard, bias=qkv_bias,
                                      replicas=kv_replicas)  # fmt: skip
        self.o_proj = row_parallel(heads * head_dim, hidden, shard, bias=o_bias)
        if qk_norm is None and config.model_type in _QK_NORM_MODEL_TYPES:
            qk_norm = RMSNorm
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm = qk_norm(head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm(head_dim, config.rms_norm_eps)
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        model: CausalLM,
        md: AttentionMetadata,
        kv_cache: PagedKVCache,
        ops: FusedElementwise | None = None,
    ) -> torch.Tensor:
        """``ops``: fused RoPE (in place on the fresh q/k) for float32 or bfloat16 CPU inputs;
        q/k norms (Qwen3) are torch code before it."""
        num_tokens = x.shape[0]
        q = linear(self.q_proj, x).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = linear(self.k_proj, x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = linear(self.v_proj, x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:  # per head, over D; new tensors
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)  # [T, Hq, D], [T, Hkv, D]
        if ops is not None and q.is_contiguous() and k.is_contiguous():
            ops.rotary_(q, k, *cos_sin)
        else:
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        o = model.attn_backend.forward(
            self.layer_idx,
            q,
            k,
            v,
            kv_cache,
            md,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )  # [T, Hq, D]
        # o [T, Hq/N, D] -> partial [T, H] on each rank -> summed over the ranks
        return self.shard.reduce(linear(self.o_proj, o.reshape(num_tokens, -1)))  # [T, H]


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported.")
        self.shard = shard
        self.gate_proj = column_parallel(hidden, inter, shard, bias=bias)
        self.up_proj = column_parallel(hidden, inter, shard, bias=bias)
        self.down_proj = row_parallel(inter, hidden, shard, bias=bias)

    def forward(self, x: torch.Tensor, ops: FusedElementwise | None = None) -> torch.Tensor:
        """x [T, H] -> [T, I/N] -> partial [T, H] -> summed over the ranks; ``ops``: fused
        SiLU x up (into the fresh gate tensor) for float32 CPU inputs (bfloat16: torch's)."""
        gate, up = linear(self.gate_proj, x), linear(self.up_proj, x)  # [T, I/N] each
        return self.shard.reduce(linear(self.down_proj, silu_mul(gate, up, ops)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, head_dim: int, window: int | None, shard: TensorShard
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, head_dim, window, shard)
        ffn: LlamaMLP | SparseMoeBlock
        if is_sparse_layer(config, layer_idx):
            ffn = SparseMoeBlock(config, shard)
        else:
            ffn = LlamaMLP(config, shard)
        self.add_module(block_name(config), ffn)  # "mlp", or Mixtral's "block_sparse_moe"
        # The same module, unregistered: the forward's handle on it whatever its name.
        self.ffn: LlamaMLP | SparseMoeBlock
        self.__dict__["ffn"] = ffn
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderLayer(Protocol):
    """What the forward reads of a decoder layer (Llama's, or a family built on it: Phi-3)."""

    @property
    def input_layernorm(self) -> RMSNorm: ...
    @property
    def post_attention_layernorm(self) -> RMSNorm: ...
    @property
    def self_attn(self) -> _Attention: ...
    @property
    def ffn(self) -> _FeedForward: ...


class _Attention(Protocol):
    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        model: CausalLM,
        md: AttentionMetadata,
        kv_cache: PagedKVCache,
        ops: FusedElementwise | None = None,
    ) -> torch.Tensor: ...


class _FeedForward(Protocol):
    def forward(self, x: torch.Tensor, ops: FusedElementwise | None = None) -> torch.Tensor: ...


class Backbone(Protocol):
    """The decoder stack a family builds (an ``nn.Module`` under ``model.``)."""

    @property
    def embed_tokens(self) -> Embedding: ...
    @property
    def layers(self) -> nn.ModuleList: ...
    @property
    def norm(self) -> RMSNorm: ...


class LlamaModel(nn.Module):
    def __init__(self, config: Any, head_dim: int, shard: TensorShard) -> None:
        super().__init__()
        windows = _sliding_windows(config, config.num_hidden_layers)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, head_dim, windows[i], shard)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral (transformers ``*ForCausalLM``
    checkpoints)."""

    def __init__(self, config: Any, shard: TensorShard = SINGLE_SHARD) -> None:
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
        self.model = self._build_model(config, head_dim, shard)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = self._build_rotary(config, head_dim)
        self._decoder_layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]

    def _build_model(self, config: Any, head_dim: int, shard: TensorShard) -> Backbone:
        """The ``nn.Module`` with ``embed_tokens``, ``layers`` (``DecoderLayer`` each), ``norm``."""
        return LlamaModel(config, head_dim, shard)

    def _build_rotary(self, config: Any, head_dim: int) -> RotaryEmbedding:
        return RotaryEmbedding(config, head_dim, torch.device("cpu"))

    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        h = self.embed_ids(input_ids, self.model.embed_tokens.weight)  # [T, H]
        if self.rotary.inv_freq.device != h.device:
            self.rotary.inv_freq = self.rotary.inv_freq.to(h.device)
        cos_sin = self.rotary.cos_sin(positions, attn_metadata.token_rope_lens, h.dtype)
        ops = self._usable_fused_ops(h)
        if ops is not None:
            return self._forward_fused(ops, h, cos_sin, attn_metadata, kv_cache)
        # Submodules' forward called directly: nn.Module.__call__ adds nothing here (no hooks).
        for layer in self._decoder_layers:
            h = h + layer.self_attn.forward(
                layer.input_layernorm.forward(h), cos_sin, self, attn_metadata, kv_cache
            )
            h = h + layer.ffn.forward(layer.post_attention_layernorm.forward(h))
        out: torch.Tensor = self.model.norm.forward(h)  # [T, H]
        return out

    def _forward_fused(
        self,
        ops: FusedElementwise,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """The forward with fused elementwise ops: ``h`` [T, H] (the embeddings, owned here) is
        the residual stream, updated in place; each residual add is fused with the norm that
        reads its sum (the next layer's input norm, or the final norm). The same math as the
        torch path up to fp32 summation order (in bfloat16, rounded where the torch path
        rounds)."""
        norms = [self.model.norm]
        for layer in reversed(self._decoder_layers):
            norms += (layer.post_attention_layernorm, layer.input_layernorm)
        norm = norms.pop()  # the first layer's input norm
        x = ops.rms_norm(h, norm.weight, norm.eps)
        for layer in self._decoder_layers:
            attn = layer.self_attn.forward(x, cos_sin, self, md, kv_cache, ops)  # [T, H]
            norm = norms.pop()
            x = ops.add_rms_norm(h, attn, norm.weight, norm.eps)  # h += attn; x = norm(h)
            mlp = layer.ffn.forward(x, ops)  # [T, H]
            norm = norms.pop()
            x = ops.add_rms_norm(h, mlp, norm.weight, norm.eps)
        assert not norms, "every norm used once"
        return x

    def _usable_fused_ops(self, h: torch.Tensor) -> FusedElementwise | None:
        """``fused_ops`` when this forward can take them: contiguous float32 or bfloat16 CPU
        hidden states, contiguous CPU norm weights of their dtype and an even head dim (checked
        once per ops object and dtype)."""
        ops = self.fused_ops
        if ops is None or h.dtype not in FUSED_DTYPES or h.device.type != "cpu":
            return None
        if not h.is_contiguous():
            return None
        checked = self.__dict__.get("_fused_ops_check")
        if checked is None or checked[0] is not ops or checked[1] != h.dtype:
            weights = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
            fits = self.head_dim % 2 == 0 and all(
                w.dtype == h.dtype and w.device.type == "cpu" and w.is_contiguous() for w in weights
            )
            checked = self.__dict__["_fused_ops_check"] = (ops, h.dtype, fits)
        return ops if checked[2] else None
