"""What every model family implements, and what the loader and runner rely on.

A family is an ``nn.Module`` whose parameter names are the transformers checkpoint names, so a
checkpoint loads by name; families declare the few exceptions (transposed Conv1D weights, buffers
to ignore, a tied LM head) through the hooks below.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from asyncpaged.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.packed_linear import linear

__all__ = ["CausalLM", "Embedding", "Linear", "linear"]


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


class CausalLM(nn.Module, metaclass=ABCMeta):
    """A decoder-only LM over a flat token batch (no padding) and a paged KV cache."""

    #: Prefix of the transformers base model ("model.", "transformer."); checkpoints saved from the
    #: base model alone omit it.
    base_model_prefix: ClassVar[str] = "model."
    #: Checkpoint key suffixes stored transposed (transformers Conv1D, ``[in, out]``).
    transposed_suffixes: ClassVar[tuple[str, ...]] = ()
    #: Checkpoint key suffixes that are buffers, not weights (ignored when present).
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: Any, *, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.config = config
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.attn_backend: AttentionBackend = TorchAttentionBackend()

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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (rows that sample) -> float32 logits [N, V]."""
        return torch.nn.functional.linear(hidden, self.lm_head_weight()).float()

    def is_ignored_checkpoint_key(self, name: str) -> bool:
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True  # some tied checkpoints store the copy anyway
        return name.endswith(self.ignored_suffixes)

    def is_transposed_checkpoint_key(self, name: str) -> bool:
        return name.endswith(self.transposed_suffixes) and name.endswith(".weight")
