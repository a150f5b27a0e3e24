"""Sparse mixture-of-experts feed-forward blocks: Qwen3-MoE and Mixtral.

Each token is routed to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts: router logits
(a bias-free linear, replicated), softmax in float32, top-k, then (Mixtral always, Qwen3-MoE when
``norm_topk_prob``) the k weights renormalised to sum to 1. Qwen3-MoE casts the weights back to the
hidden dtype before weighting the experts' outputs; Mixtral keeps them float32 and casts the
weighted output (both as transformers 5 does). The output is the routing-weighted sum of the
chosen experts' outputs, accumulated in expert order (transformers' ``index_add_`` order).

Dispatch is batched: the step's (token, slot) pairs are sorted by expert, each expert with tokens
runs one GEMM per projection over all its tokens, and the weighted results are scatter-added back.

transformers fields honoured: ``num_experts`` / ``num_local_experts``, ``num_experts_per_tok``,
``moe_intermediate_size`` (Qwen3-MoE experts) or ``intermediate_size`` (Mixtral experts),
``norm_topk_prob``, ``decoder_sparse_step`` and ``mlp_only_layers`` (which Qwen3-MoE layers are
sparse), ``hidden_act`` (``silu`` only). ``router_jitter_noise`` and the router aux-loss fields act
in training only. Checkpoint names: ``mlp.gate`` + ``mlp.experts.E.{gate,up,down}_proj``
(Qwen3-MoE) and ``block_sparse_moe.gate`` + ``block_sparse_moe.experts.E.{w1,w3,w2}`` (Mixtral;
w1 = gate, w3 = up, w2 = down).

Tensor parallel: every expert's intermediate dim is split (gate/up column-parallel, down
row-parallel); the router is replicated, so every rank routes identically, and the summed
partial outputs are reduced once per block.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from asyncpaged.model.base import (
    FusedElementwise,
    Linear,
    TensorShard,
    column_parallel,
    linear,
    row_parallel,
    silu_mul,
)
from asyncpaged.model.errors import UnsupportedModelError

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")

#: model_type -> (block attribute name, expert gate / up / down projection names)
_CHECKPOINT_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}

#: config fields of MoE variants not implemented here (shared experts, grouped routing)
_UNSUPPORTED_FIELDS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "num_shared_experts",
    "n_group",
    "topk_group",
)


def _num_experts(config: Any) -> int:
    count = getattr(config, "num_experts", None)
    if count is None:
        count = config.num_local_experts
    return int(count)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has a MoE block (else the dense MLP), as transformers decides."""
    if config.model_type == "mixtral":
        return True
    if config.model_type != "qwen3_moe":
        return False
    step = int(getattr(config, "decoder_sparse_step", 1))
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and _num_experts(config) > 0
        and (layer_idx + 1) % step == 0
    )


def block_name(config: Any) -> str:
    """The checkpoint attribute name of a decoder layer's feed-forward block."""
    if config.model_type not in MOE_MODEL_TYPES:
        return "mlp"
    return _CHECKPOINT_NAMES[config.model_type][0]


def check_moe_config(config: Any) -> None:
    """Raise UnsupportedModelError naming the first MoE field whose math is not implemented."""
    for field in _UNSUPPORTED_FIELDS:
        if getattr(config, field, None):
            raise UnsupportedModelError(f"{field}={getattr(config, field)!r} is not supported.")
    num_experts, top_k = _num_experts(config), int(config.num_experts_per_tok)
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} must be between 1 and the number of experts "
            f"({num_experts})."
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported.")


class SwiGLUExpert(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``, under its checkpoint projection names."""

    def __init__(
        self, hidden: int, inter: int, names: tuple[str, str, str], shard: TensorShard
    ) -> None:
        super().__init__()
        self.names = names
        gate_name, up_name, down_name = names
        self.add_module(gate_name, column_parallel(hidden, inter, shard, bias=False))
        self.add_module(up_name, column_parallel(hidden, inter, shard, bias=False))
        self.add_module(down_name, row_parallel(inter, hidden, shard, bias=False))

    def forward(self, x: torch.Tensor, ops: FusedElementwise | None = None) -> torch.Tensor:
        """x [n, H] -> partial [n, H] (this rank's share of the intermediate dim)."""
        gate_proj, up_proj, down_proj = (self._modules[name] for name in self.names)
        assert isinstance(gate_proj, Linear)
        assert isinstance(up_proj, Linear)
        assert isinstance(down_proj, Linear)
        gate, up = linear(gate_proj, x), linear(up_proj, x)  # [n, I/N] each
        return linear(down_proj, silu_mul(gate, up, ops))  # [n, H]


class SparseMoeBlock(nn.Module):
    """Router + experts of a Qwen3-MoE or Mixtral layer (see the module docstring)."""

    # The experts' token counts are read on the host (one GEMM per expert that has tokens),
    # and a padded row would take experts too: no CUDA graph (``CausalLM.cuda_graph_safe``).
    host_synced: ClassVar[bool] = True

    def __init__(self, config: Any, shard: TensorShard) -> None:
        super().__init__()
        check_moe_config(config)
        mixtral = config.model_type == "mixtral"
        self.num_experts, self.top_k = _num_experts(config), int(config.num_experts_per_tok)
        self.renormalise = mixtral or bool(getattr(config, "norm_topk_prob", False))
        self.weights_in_hidden_dtype = not mixtral  # Qwen3-MoE casts the routing weights back
        self.shard = shard
        hidden = config.hidden_size
        inter = config.intermediate_size if mixtral else config.moe_intermediate_size
        names = _CHECKPOINT_NAMES[config.model_type][1]
        self.gate = Linear(hidden, self.num_experts, bias=False)  # the router, replicated
        self.experts = nn.ModuleList(
            SwiGLUExpert(hidden, inter, names, shard) for _ in range(self.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k] int64), as transformers."""
        logits = linear(self.gate, x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_hidden_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, ops: FusedElementwise | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]: the routing-weighted sum of each token's experts, summed over the
        ranks. One GEMM per projection of each expert that has tokens, whatever T is."""
        weights, experts = self.route(x)  # [T, k] each
        flat = experts.reshape(-1)  # [T*k]: slot t*k + j is token t's j-th choice
        order = torch.argsort(flat, stable=True)  # [T*k], grouped by expert
        tokens = order // self.top_k  # [T*k] token of each sorted slot
        sorted_weights = weights.reshape(-1)[order].unsqueeze(-1)  # [T*k, 1]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # [E]
        gathered = x[tokens]  # [T*k, H]
        out = torch.zeros_like(x)  # [T, H]
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count == 0:
                continue
            rows = slice(start, start + count)
            start += count
            assert isinstance(expert, SwiGLUExpert)
            y = expert.forward(gathered[rows], ops)  # [n, H]
            out.index_add_(0, tokens[rows], (y * sorted_weights[rows]).to(out.dtype))
        return self.shard.reduce(out)
