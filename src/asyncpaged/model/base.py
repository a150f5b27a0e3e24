"""What every model family implements, and what the loader and runner rely on.

A family is an ``nn.Module`` whose parameter names are the transformers checkpoint names, so a
checkpoint loads by name; families declare the few exceptions (transposed Conv1D weights, buffers
to ignore, a tied LM head) through the hooks below.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from asyncpaged.config import kv_head_replicas
from asyncpaged.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.errors import UnsupportedModelError
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.packed_linear import linear, packed_matmul, runs_on_onednn
from asyncpaged.model.quantized_linear import QuantizedRows, QuantizedWeight
from asyncpaged.model.row_buckets import bucketed

__all__ = [
    "SINGLE_SHARD",
    "CausalLM",
    "Embedding",
    "FusedElementwise",
    "Linear",
    "ShardRule",
    "TensorShard",
    "column_parallel",
    "linear",
    "row_parallel",
]


class Linear(nn.Linear):
    """``nn.Linear`` built uninitialised (``torch.empty``): its weights come from the checkpoint.

    Building on the meta device instead costs about 0.8 s of one-time torch imports per process,
    and a random init of a large model costs seconds.
    """

    def reset_parameters(self) -> None:
        """No init: the loader assigns every parameter."""


class Embedding(nn.Embedding):
    """``nn.Embedding`` built uninitialised, like :class:`Linear`."""

    def reset_parameters(self) -> None:
        """No init: the loader assigns every parameter."""


# ---- tensor parallelism ------------------------------------------------------------------------
#
# A split linear records how it is split in its __dict__ (SHARD_ATTR), for the loader: "column" =
# along dim 0 of the [out, in] weight (output features; its bias too), "row" = along dim 1 (input
# features; its outputs are partial sums, and its bias lives on rank 0 only).
ShardKind = Literal["column", "row"]
SHARD_ATTR = "tp_shard_kind"


@dataclass(frozen=True, slots=True)
class ShardRule:
    """How the loader slices one checkpoint tensor for this rank.

    ``dim`` is the split dimension in the model's layout; ``parts`` are the relative widths of
    the fused parts the dimension holds, in order (GPT-2's q|k|v: (1, 1, 1); Phi-3's q|k|v:
    (heads, KV heads, KV heads)), each split on its own, so a rank gets its share of every
    part, concatenated. ``replicas[i]``: how many ranks hold each slice of part ``i`` (KV heads
    fewer than the ranks: rank ``r`` holds slice ``r // replicas[i]``); 1 for every part when
    empty.
    """

    dim: int
    parts: tuple[int, ...] = (1,)
    replicas: tuple[int, ...] = ()

    def slices(self, world_size: int) -> tuple[tuple[int, int, int], ...]:
        """(part width in units, distinct slices of it, ranks per slice) for each part."""
        replicas = self.replicas or (1,) * len(self.parts)
        return tuple((p, world_size // r, r) for p, r in zip(self.parts, replicas, strict=True))

    def full_width(self, width: int, world_size: int) -> int:
        """The checkpoint's width of the split dimension, from one rank's ``width``."""
        share = sum(Fraction(p, ways) for p, ways, _ in self.slices(world_size))
        return int(width / share * sum(self.parts))


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorShard:
    """Which tensor-parallel shard of the model this process holds (Megatron-style).

    Invariants: ``0 <= rank < world_size``; ``all_reduce`` is None exactly when ``world_size`` is
    1 (nothing is reduced, and the model is the plain single-device one). ``all_reduce`` sums a
    tensor in place over every rank; every rank calls it in the same order.
    """

    rank: int = 0
    world_size: int = 1
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, f"rank {self.rank} of {self.world_size}"
        assert (self.all_reduce is None) == (self.world_size == 1), "all_reduce iff world_size > 1"

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, KV heads, MLP width): ``total / world_size``."""
        if total % self.world_size:
            raise UnsupportedModelError(
                f"tensor_parallel_size={self.world_size} must divide {what} ({total})."
            )
        return total // self.world_size

    def kv_heads(self, total: int) -> int:
        """This rank's KV heads (``config.kv_head_replicas``): its share, or one replicated
        head where the ranks outnumber the heads by a whole factor."""
        num, replicas = kv_head_replicas(total, self.world_size)
        if replicas == 1:
            return self.split(total, "num_key_value_heads")
        return num

    def kv_replicas(self, total: int) -> int:
        """How many ranks hold each of this model's KV heads (1: each its own share)."""
        return kv_head_replicas(total, self.world_size)[1]

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial outputs of a row-parallel layer over the ranks (in place)."""
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x


SINGLE_SHARD = TensorShard()


def column_parallel(
    in_features: int,
    out_features: int,
    shard: TensorShard,
    *,
    bias: bool = True,
    parts: tuple[int, ...] = (1,),
    replicas: tuple[int, ...] = (),
) -> Linear:
    """A linear whose output features are split: ``out_features`` is the full width; the rank
    holds one slice of the rows of each fused part (``parts``: their relative widths;
    ``replicas``: ranks per slice; see :class:`ShardRule`)."""
    rule = ShardRule(0, parts, replicas)
    unit = out_features // sum(parts)
    assert unit * sum(parts) == out_features, f"{out_features} output features, parts {parts}"
    width = 0
    for size, ways, _ in rule.slices(shard.world_size):
        if ways < 1 or (size * unit) % ways:
            raise UnsupportedModelError(
                f"tensor_parallel_size={shard.world_size} cannot split a layer part of "
                f"{size * unit} features {ways} ways."
            )
        width += size * unit // ways
    layer = Linear(in_features, width, bias=bias)
    kind: ShardKind = "column"
    layer.__dict__[SHARD_ATTR] = (kind, rule)
    return layer


def row_parallel(in_features: int, out_features: int, shard: TensorShard, *, bias: bool = True
                 ) -> Linear:  # fmt: skip
    """A linear whose input features are split; its outputs are partial sums until
    ``shard.reduce``. The bias lives on rank 0 only, so the sum adds it exactly once."""
    layer = Linear(
        shard.split(in_features, "a layer's input width"), out_features,
        bias=bias and shard.rank == 0,
    )  # fmt: skip
    kind: ShardKind = "row"
    layer.__dict__[SHARD_ATTR] = (kind, ShardRule(1))
    return layer


#: the dtypes the fused elementwise ops take (every tensor of a call the same one)
FUSED_DTYPES = (torch.float32, torch.bfloat16)


class FusedElementwise(Protocol):
    """Fused CPU elementwise ops (``asyncpaged.kernels.cpu_fused.FusedOps``), unchecked: CPU
    tensors of one dtype in ``FUSED_DTYPES`` with contiguous rows, rounding in bfloat16 where the
    torch code does. A family that uses them keeps its torch code for every call they cannot
    take."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, H] -> ``weight * (x * rsqrt(mean(x^2) + eps))`` [T, H] (new)."""
        ...

    def add_rms_norm(
        self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` in place, then the norm of it (new) [T, H]."""
        ...

    def rotary_(
        self, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """q [T, Hq, D], k [T, Hkv, D] rotated in place (rotate-half RoPE) by cos/sin [T, D]."""
        ...

    def silu_mul(
        self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``silu(gate) * up`` into ``out`` (may be gate; default new); float32 only."""
        ...


def silu_mul(gate: torch.Tensor, up: torch.Tensor, ops: FusedElementwise | None) -> torch.Tensor:
    """``silu(gate) * up``: through ``ops`` (into ``gate``) for contiguous float32 inputs, else
    torch's ops (bfloat16 among them: fused, it measured no faster)."""
    fits = gate.dtype == torch.float32 and gate.is_contiguous() and up.is_contiguous()
    if ops is not None and fits:
        return ops.silu_mul(gate, up, gate)
    return torch.nn.functional.silu(gate) * up


class CausalLM(nn.Module, metaclass=ABCMeta):
    """A decoder-only LM over a flat token batch (no padding) and a paged KV cache."""

    #: Prefix of the transformers base model ("model.", "transformer."); checkpoints saved from the
    #: base model alone omit it.
    base_model_prefix: ClassVar[str] = "model."
    #: Checkpoint key suffixes stored transposed (transformers Conv1D, ``[in, out]``).
    transposed_suffixes: ClassVar[tuple[str, ...]] = ()
    #: Checkpoint key suffixes that are buffers, not weights (ignored when present).
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    #: Checkpoint key prefixes of parts this family does not run (a multimodal checkpoint's
    #: vision tower), ignored.
    ignored_prefixes: ClassVar[tuple[str, ...]] = ()
    #: (checkpoint prefix, parameter prefix) pairs: a multimodal checkpoint's language model is
    #: stored under its own prefix (``language_model.model.`` -> ``model.``).
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: Final logit softcapping (Gemma 2): logits become ``cap * tanh(logits / cap)`` (float32).
    final_logit_softcap: float | None = None
    #: longrope models: ``original_max_position_embeddings``, past which a sequence rotates with
    #: the long factors (the scheduler recomputes a request that grows past it; see
    #: ``SchedulerConfig.rope_switch_len``). None for every other model.
    rope_switch_len: int | None = None

    def __init__(
        self,
        config: Any,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        shard: TensorShard = SINGLE_SHARD,
    ) -> None:
        """``num_kv_heads`` is this rank's share (``shard.split`` of the model's KV heads)."""
        super().__init__()
        self.config = config
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.shard = shard
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.attn_backend: AttentionBackend = TorchAttentionBackend()
        # Set by the runner for CPU float32 models (``fused_elementwise``); families that have
        # no fused path ignore it.
        self.fused_ops: FusedElementwise | None = None
        # Set by the runner (packed linears on, bf16 screen off): the LM head in oneDNN's
        # packed layout for ``compute_logits`` (a copy; ``lm_head_weight`` stays as it is).
        self.packed_lm_head: torch.Tensor | None = None
        #: set by the runner for bfloat16 CPU models (``asyncpaged.kernels.cpu_argmax``): the
        #: row argmax ``head_argmax`` runs on the head's bf16 logits.
        self.native_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
        #: set by the GGUF loader where the file stores the LM head quantized: ``head_logits``
        #: multiplies by it, and ``lm_head_weight()`` is an empty tensor of the model's dtype.
        self.quantized_head: QuantizedWeight | None = None
        #: set by the GGUF loader where the file stores the token embedding quantized (the same
        #: object as ``quantized_head`` when the two are tied): ``embed_ids`` reads its rows.
        self.quantized_embedding: QuantizedRows | None = None

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, H] (after the final norm)."""

    @abstractmethod
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] output embedding (the input embedding when tied)."""

    def vocab_rows(self) -> int:
        """The LM head's rows: the vocabulary the logits cover."""
        head = self.quantized_head
        return int(head.out_features if head is not None else self.lm_head_weight().shape[0])

    def embed_ids(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the token embedding's rows [T, H] in ``weight``'s dtype: a lookup
        in ``weight``, or the rows of ``quantized_embedding`` dequantized (then ``weight`` is
        the empty parameter that only carries the dtype)."""
        table = self.quantized_embedding
        if table is None:
            return torch.nn.functional.embedding(input_ids, weight)
        return table.rows(input_ids).to(dtype=weight.dtype)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (rows that sample) -> the LM head's logits [N, V] in the model's dtype,
        before ``compute_logits`` widens and softcaps them. oneDNN GEMMs run with the rows
        bucketed (``row_buckets``): one kept primitive per bucket, not per row count. A head
        kept quantized multiplies in float32 (``QuantizedWeight.matmul``)."""
        quantized = self.quantized_head
        if quantized is not None:
            rows = hidden if hidden.dtype == torch.float32 else hidden.float()
            return quantized.matmul(rows.contiguous()).to(hidden.dtype)
        packed = self.packed_lm_head
        if packed is not None and hidden.device.type == "cpu":
            return packed_matmul(hidden, packed)  # [N, V], bucketed
        weight = self.lm_head_weight()
        if runs_on_onednn(hidden):
            return bucketed(lambda rows: torch.nn.functional.linear(rows, weight), hidden)
        return torch.nn.functional.linear(hidden, weight)  # [N, V]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (rows that sample) -> float32 logits [N, V], softcapped when
        ``final_logit_softcap`` is set."""
        logits = self.head_logits(hidden).float()
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def head_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> the greedy tokens [N] of ``compute_logits``' rows (their
        ``torch.argmax``: the first maximal id, or the first NaN's) straight from the head's
        bfloat16 logits through ``native_argmax``, without widening [N, V] to float32 (a
        bf16 -> fp32 conversion is exact and keeps the order); None where that does not apply
        (no native argmax, other logits, a final softcap)."""
        argmax = self.native_argmax
        if argmax is None or self.final_logit_softcap is not None:
            return None
        if hidden.dtype != torch.bfloat16 or hidden.device.type != "cpu" or hidden.dim() != 2:
            return None
        logits = self.head_logits(hidden)
        if logits.dtype != torch.bfloat16 or logits.shape[1] == 0 or logits.stride(-1) != 1:
            return None
        return argmax(logits)

    def cuda_graph_safe(self) -> bool:
        """Whether a CUDA graph can capture the forward of a padded decode batch: no submodule
        reads device values back on the host or mixes rows (``host_synced``: MoE routing)."""
        return not any(getattr(m, "host_synced", False) for m in self.modules())

    def is_ignored_checkpoint_key(self, name: str) -> bool:
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True  # some tied checkpoints store the copy anyway
        return name.endswith(self.ignored_suffixes) or name.startswith(self.ignored_prefixes)

    def parameter_name(self, checkpoint_name: str) -> str:
        """The parameter a checkpoint key names, after ``checkpoint_renames``."""
        for stored, ours in self.checkpoint_renames:
            if checkpoint_name.startswith(stored):
                return ours + checkpoint_name[len(stored) :]
        return checkpoint_name

    def shard_rules(self) -> dict[str, ShardRule]:
        """Parameter name -> how its checkpoint tensor is sliced for this rank (absent names
        are replicated). Empty for a single shard."""
        if self.shard.world_size == 1:
            return {}
        rules: dict[str, ShardRule] = {}
        for prefix, module in self.named_modules():
            tag = module.__dict__.get(SHARD_ATTR)
            if tag is None:
                continue
            kind, rule = tag
            rules[f"{prefix}.weight"] = rule
            if kind == "column":
                rules[f"{prefix}.bias"] = rule
        return rules

    def dropped_checkpoint_keys(self) -> set[str]:
        """Checkpoint tensors this rank does not hold: row-parallel biases (rank 0 has them)."""
        if self.shard.rank == 0:
            return set()
        return {
            f"{prefix}.bias"
            for prefix, module in self.named_modules()
            if module.__dict__.get(SHARD_ATTR, ("",))[0] == "row"
        }

    def is_transposed_checkpoint_key(self, name: str) -> bool:
        return name.endswith(self.transposed_suffixes) and name.endswith(".weight")
