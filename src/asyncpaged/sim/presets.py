"""Model shapes and GPU specifications for the simulator, and the KV budget they leave.

A model's KV bytes per token are ``2 (K and V) * num_layers * num_kv_heads * head_dim *
dtype_bytes``: OPT-13B stores 2 * 40 * 40 * 128 * 2 = 819,200 bytes (800 KiB) per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What the cost model needs of a decoder-only transformer.

    Invariants: ``num_heads % num_kv_heads == 0``; ``num_params`` counts every weight (embeddings
    included), all stored with ``dtype_bytes`` each.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool  # SwiGLU (three projections) instead of fc1/fc2
    dtype_bytes: int = 2
    max_model_len: int = 2048
    tied_embeddings: bool = True  # else the LM head is a second vocab x hidden matrix

    def __post_init__(self) -> None:
        if min(self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads) < 1:
            raise ValueError(f"model shape must be positive, got {self}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})."
            )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def num_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = h * q + 2 * h * kv + q * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        embeddings = (1 if self.tied_embeddings else 2) * self.vocab_size * h
        return self.num_layers * (attention + mlp) + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @classmethod
    def from_hf_config(
        cls, config: str | Path | dict[str, Any], dtype_bytes: int = 2
    ) -> ModelShape:
        """From a transformers ``config.json`` (a path to it or its directory, or its dict)."""
        if isinstance(config, dict):
            cfg: dict[str, Any] = config
        else:
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            cfg = json.loads(path.read_text())
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        kind = str(cfg.get("model_type", ""))
        ffn = cfg.get("intermediate_size") or cfg.get("ffn_dim") or cfg.get("n_inner")
        return cls(
            name=str(cfg.get("_name_or_path") or kind or "model"),
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(ffn or 4 * hidden),
            vocab_size=int(cfg["vocab_size"]),
            gated_mlp=kind not in ("opt", "gpt2"),
            dtype_bytes=dtype_bytes,
            max_model_len=int(cfg.get("max_position_embeddings") or 2048),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden,
        vocab_size=50272,
        gated_mlp=False,
    )


MODELS: dict[str, ModelShape] = {
    "opt-13b": _opt("opt-13b", 40, 5120, 40),
    "opt-66b": _opt("opt-66b", 64, 9216, 72),
    "opt-175b": _opt("opt-175b", 96, 12288, 96),
    "llama-13b": ModelShape(
        name="llama-13b",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=13824,
        vocab_size=32000,
        gated_mlp=True,
        tied_embeddings=False,
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """One accelerator: memory, HBM bandwidth, dense fp16/bf16 tensor FLOP rate, host link.

    Invariant: every rate and size is positive.
    """

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops_per_s: float
    pcie_bytes_per_s: float  # host <-> device copies (swap), effective

    def __post_init__(self) -> None:
        if (
            min(
                self.memory_bytes,
                self.bandwidth_bytes_per_s,
                self.flops_per_s,
                self.pcie_bytes_per_s,
            )
            <= 0
        ):
            raise ValueError(f"GPU specification must be positive, got {self}.")


GB = 10**9
GIB = 1 << 30
GPUS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec(
        name="a100-40gb",
        memory_bytes=40 * GIB,
        bandwidth_bytes_per_s=1555 * GB,
        flops_per_s=312e12,
        pcie_bytes_per_s=25 * GB,
    ),
    "a100-80gb": GpuSpec(
        name="a100-80gb",
        memory_bytes=80 * GIB,
        bandwidth_bytes_per_s=2039 * GB,
        flops_per_s=312e12,
        pcie_bytes_per_s=25 * GB,
    ),
    "h100-80gb": GpuSpec(
        name="h100-80gb",
        memory_bytes=80 * GIB,
        bandwidth_bytes_per_s=3350 * GB,
        flops_per_s=989e12,
        pcie_bytes_per_s=50 * GB,
    ),
    "h200": GpuSpec(
        name="h200",
        memory_bytes=141 * GB,
        bandwidth_bytes_per_s=4800 * GB,
        flops_per_s=989e12,
        pcie_bytes_per_s=50 * GB,
    ),
}


def kv_cache_bytes(
    model: ModelShape, gpu: GpuSpec, *, gpu_memory_utilization: float = 0.9, num_gpus: int = 1
) -> int:
    """Bytes left for the KV cache: the share of memory the engine may use, minus the weights
    (vLLM's ``gpu_memory_utilization``; activations are assumed to fit in the rest)."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
    usable = int(gpu.memory_bytes * num_gpus * gpu_memory_utilization)
    left = usable - model.weight_bytes
    if left <= 0:
        raise ValueError(
            f"{model.name} needs {model.weight_bytes / GIB:.1f} GiB of weights but "
            f"{num_gpus} x {gpu.name} at utilization {gpu_memory_utilization} gives "
            f"{usable / GIB:.1f} GiB; use more GPUs."
        )
    return left


def num_kv_blocks(
    model: ModelShape,
    gpu: GpuSpec,
    *,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    num_gpus: int = 1,
) -> int:
    """Device KV blocks of ``block_size`` tokens that fit next to the weights."""
    budget = kv_cache_bytes(
        model, gpu, gpu_memory_utilization=gpu_memory_utilization, num_gpus=num_gpus
    )
    return budget // (model.kv_bytes_per_token * block_size)
