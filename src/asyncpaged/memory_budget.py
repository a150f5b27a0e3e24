"""The KV cache's share of a CUDA device (vLLM's ``gpu_memory_utilization``).

Without ``num_device_blocks`` or ``kv_cache_bytes`` an engine on CUDA gives its KV cache what is
left of ``gpu_memory_utilization`` x the device's memory once the weights are counted (one
rank's share under tensor parallelism; a draft model's whole, and its cache's bytes per block)
and a reserve for a step's transient tensors::

    kv bytes = utilization x device memory - weights - reserve
    reserve  = 2 x (batched tokens x a layer's widest per-token tensors in float32
                    + sampling rows x vocabulary x 20 bytes: float32 logits, probabilities and
                      sorted values, int64 indices)
               + 1 GiB (the CUDA context, cuBLAS workspaces, the allocator's slack, graphs)

vLLM measures the activations with a profiling forward instead; this estimate needs no loaded
model, so the block count is known before the runner starts (in this process, its own or the
tensor-parallel ranks), and errs on the generous side. The weights are counted from the
checkpoint's safetensors headers (element counts, read without loading) at the dtype they load
in. CPUs keep the fixed default (``config.DEFAULT_KV_CACHE_BYTES``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncpaged._log import get_logger
from asyncpaged.config import EngineConfig, KVShape
from asyncpaged.errors import InvalidRequestError
from asyncpaged.model.loader import load_config, text_config

log = get_logger(__name__)

GIB = 2**30
CONTEXT_RESERVE_BYTES = GIB
_SAMPLING_BYTES_PER_LOGIT = 4 + 4 + 4 + 8


def checkpoint_weight_bytes(
    path: str | Path, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> int:
    """The bytes of a checkpoint's weights loaded in ``dtype`` on one rank: every floating
    tensor's element count (safetensors headers) x its size, other tensors as stored; under
    tensor parallelism the embeddings, the LM head and the norms whole (replicated,
    docs/distributed.md) and the rest split. ``*.bin`` files count by size, all split."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).iterdir()):
        if file.suffix == ".bin":
            total += file.stat().st_size // tensor_parallel_size
        elif file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    piece = f.get_slice(name)
                    numel = math.prod(piece.get_shape())
                    stored = _SAFETENSORS_BYTES.get(piece.get_dtype(), 1)
                    floating = piece.get_dtype() in ("F64", "F32", "F16", "BF16")
                    size = numel * (dtype.itemsize if floating else stored)
                    replicated = any(part in name for part in _REPLICATED)
                    total += size if replicated else size // tensor_parallel_size
    return total


_REPLICATED = ("embed", "lm_head", "wte", "wpe", "norm")  # parts of replicated tensors' names


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                      "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def activation_reserve_bytes(hf_config: Any, *, batched_tokens: int, sampling_rows: int) -> int:
    """The reserve of the module docstring for a text model's config."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    width = max(
        int(getattr(hf_config, "intermediate_size", None) or 4 * hidden),
        int(getattr(hf_config, "moe_intermediate_size", None) or 0)
        * int(getattr(hf_config, "num_experts_per_tok", None) or 1),
    )
    per_token = (4 * hidden + 3 * width + (heads + 2 * kv_heads) * head_dim) * 4
    rows = min(batched_tokens, sampling_rows)
    logits = rows * int(hf_config.vocab_size) * _SAMPLING_BYTES_PER_LOGIT
    return 2 * (batched_tokens * per_token + logits) + CONTEXT_RESERVE_BYTES


@dataclass(frozen=True, slots=True)
class CudaBudget:
    """How one rank's device memory splits (bytes), for the ``kv_budget`` log line."""

    device_bytes: int
    utilization: float
    weights: int
    reserve: int

    @property
    def kv_bytes(self) -> int:
        return int(self.utilization * self.device_bytes) - self.weights - self.reserve

    def check(self, min_kv_bytes: int) -> int:
        """The KV bytes, or a typed error when they fall short of ``min_kv_bytes``."""
        if self.kv_bytes < min_kv_bytes:
            raise InvalidRequestError(
                f"gpu_memory_utilization={self.utilization} of {self.device_bytes / GIB:.1f} GiB "
                f"leaves {max(self.kv_bytes, 0) / GIB:.2f} GiB for the KV cache after "
                f"{self.weights / GIB:.1f} GiB of weights and a {self.reserve / GIB:.1f} GiB "
                "reserve for a step's activations: less than one sequence of max_model_len "
                "needs. Lower max_model_len, raise gpu_memory_utilization, lower "
                "max_num_batched_tokens / max_num_seqs, or set kv_cache_bytes / "
                "num_device_blocks."
            )
        return self.kv_bytes


def cuda_device_bytes(device: str) -> int:
    """The device's total memory, from its properties."""
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaMemory:
    """What ``gpu_memory_utilization``'s budget reads of the checkpoints (``memory_budget``)."""

    path: Path  # the model's directory
    draft_config: Any = None  # a draft model's (speculative "draft_model"), whole on rank 0
    draft_path: Path | None = None


def cuda_memory(
    cfg: EngineConfig, path: Path, resolve: Callable[[str, str | None], Path]
) -> CudaMemory | None:
    """The checkpoints' facts for the KV budget, or None where it does not apply (not CUDA, or
    a KV size configured). Blocking: the draft model's checkpoint is found and read."""
    if not cfg.device.startswith("cuda") or cfg.num_device_blocks or cfg.kv_cache_bytes:
        return None
    spec = cfg.speculative_config
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return CudaMemory(path=path)
    draft_path = resolve(spec.model, None)
    return CudaMemory(path=path, draft_config=text_config(load_config(draft_path)),
                      draft_path=draft_path)  # fmt: skip


def cuda_kv_budget(
    cfg: EngineConfig,
    memory: CudaMemory,
    hf_config: Any,
    dtype: torch.dtype,
    shape: KVShape,
    max_model_len: int,
) -> tuple[int, int]:
    """(KV bytes per rank, a draft cache's bytes per block) under ``gpu_memory_utilization``;
    a typed error where not even one sequence of ``max_model_len`` would fit."""
    weights = checkpoint_weight_bytes(memory.path, dtype, cfg.tensor_parallel_size)
    draft_block = 0
    if memory.draft_path is not None:
        weights += checkpoint_weight_bytes(memory.draft_path, dtype)
        draft_shape = KVShape.from_hf_config(
            memory.draft_config, shape.dtype_bytes, scale_bytes=shape.scale_bytes
        )
        draft_block = draft_shape.block_bytes(cfg.block_size)
    spec = cfg.speculative_config
    rows = cfg.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
    reserve = activation_reserve_bytes(
        hf_config, batched_tokens=cfg.max_num_batched_tokens, sampling_rows=rows
    )
    budget = CudaBudget(cuda_device_bytes(cfg.device), cfg.gpu_memory_utilization, weights, reserve)
    per_block = shape.block_bytes(cfg.block_size) + draft_block
    kv_bytes = budget.check(-(-max_model_len // cfg.block_size) * per_block)
    log.info("kv_budget", device_gib=round(budget.device_bytes / GIB, 2),
             utilization=budget.utilization, weights_gib=round(weights / GIB, 2),
             reserve_gib=round(reserve / GIB, 2), kv_cache_gib=round(kv_bytes / GIB, 2),
             blocks=kv_bytes // per_block)  # fmt: skip
    return kv_bytes, draft_block
