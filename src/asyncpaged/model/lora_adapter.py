"""PEFT LoRA adapter directories, read with json and safetensors (no peft import).

An adapter is ``adapter_config.json`` plus ``adapter_model.safetensors`` whose keys are
``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r]). The
layer's output gains ``scaling * (x @ A.T) @ B.T``, with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` under rsLoRA), as PEFT computes it for an unmerged adapter.

Supported: the projections of the decoder layers (q/k/v/o, gate/up/down, and the fused ones of
the families that fuse them: Phi-3's ``qkv_proj`` / ``gate_up_proj``, GPT-2's ``c_attn``).
Refused (:class:`LoRAAdapterError`): biases (``bias`` other than "none"), ``modules_to_save``,
DoRA, per-module ``rank_pattern`` / ``alpha_pattern``, embedding, LM-head and MoE-expert
adapters, and any key of another kind.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_REFUSED_MODULES = ("lm_head", "embed_tokens", "wte", "wpe", "embed_positions", "embed_out")


class LoRAAdapterError(ValueError):
    """An adapter directory that cannot be served: missing, malformed, or asking for what the
    engine or the model does not have."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterInfo:
    """What a check of an adapter found: its digest (sha256 over the config's and the
    weights' bytes), rank, scaling and the modules it targets (checkpoint names, without
    ``.weight``), with each one's (out, in)."""

    digest: str
    rank: int
    scaling: float
    modules: tuple[tuple[str, tuple[int, int]], ...]
    files: tuple[tuple[str, bytes], ...]  # (file name, the bytes the digest covers)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterWeights:
    """An adapter's tensors: module (checkpoint name, without ``.weight``) -> (A [r, in],
    B [out, r]), and its scaling."""

    digest: str
    rank: int
    scaling: float
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    files: tuple[tuple[str, bytes], ...]  # (file name, the bytes the digest covers)


def _files(path: str) -> tuple[Path, Path]:
    directory = Path(path)
    if not directory.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {path!r} is not a directory.")
    config, weights = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for f in (config, weights):
        if not f.is_file():
            raise LoRAAdapterError(f"LoRA adapter {path!r} has no {f.name}.")
    return config, weights


def _scaling(config: Mapping[str, object], path: str) -> tuple[int, float]:
    """The config's rank and scaling, once the config asks for nothing refused."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(
            f"LoRA adapter {path!r}: peft_type {config.get('peft_type')!r} is not LORA."
        )
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"LoRA adapter {path!r}: bias={config.get('bias')!r} is not supported (only 'none')."
        )
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {key} is not supported.")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: DoRA (use_dora) is not supported.")
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: r must be an int >= 1, got {r!r}.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: lora_alpha must be a number.")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scaling)


def _read_config(config_file: Path, path: str) -> tuple[bytes, dict[str, object]]:
    raw = config_file.read_bytes()
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object.")
    return raw, config


def _read_tensors(weights_file: Path, path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(os.fspath(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} cannot be read: {exc}"
                               ) from exc  # fmt: skip


def read_adapter(path: str) -> AdapterWeights:
    """The adapter at ``path``, checked for what this module refuses (not against a model)."""
    config_file, weights_file = _files(path)
    raw_config, config = _read_config(config_file, path)
    rank, scaling = _scaling(config, path)
    raw_weights = weights_file.read_bytes()
    tensors = _read_tensors(weights_file, path)
    digest = hashlib.sha256(
        b"%d:" % len(raw_config) + raw_config + b"%d:" % len(raw_weights) + raw_weights
    ).hexdigest()
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: tensor {key!r} is not supported "
                "(only lora_A / lora_B weights of linear layers)."
            )
        module = match["module"]
        if ".experts." in module or "block_sparse_moe" in module:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} is an MoE expert "
                "layer; such adapters are not supported."
            )
        if module.rsplit(".", 1)[-1] in _REFUSED_MODULES:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} is an embedding or "
                "the LM head; such adapters are not supported."
            )
        halves.setdefault(module, {})[match["ab"]] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in halves.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} needs a 2-D lora_A and lora_B."
            )
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} has rank {a.shape[0]}/{b.shape[1]}, "
                f"the config says r={rank}."
            )
        weights[module] = (a, b)
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {path!r} holds no LoRA weights.")
    files = ((CONFIG_FILE, raw_config), (WEIGHTS_FILE, raw_weights))
    return AdapterWeights(digest=digest, rank=rank, scaling=scaling, weights=weights, files=files)


def check_adapter(
    path: str, *, max_lora_rank: int, base_shapes: Mapping[str, tuple[int, int]]
) -> AdapterInfo:
    """Check the adapter at ``path`` against the engine's ``max_lora_rank`` and the base
    model's linear weights (checkpoint name without ``.weight`` -> (out, in)); raises
    :class:`LoRAAdapterError` naming the first problem."""
    adapter = read_adapter(path)
    if adapter.rank > max_lora_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {path!r} has rank {adapter.rank}, above max_lora_rank={max_lora_rank}."
        )
    modules = []
    for module, (a, b) in sorted(adapter.weights.items()):
        shape = base_shapes.get(module)
        if shape is None:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r} targets {module!r}, which the model lacks."
            )
        if (b.shape[0], a.shape[1]) != shape:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r}: module {module!r} is {b.shape[0]}x{a.shape[1]}, the "
                f"model's is {shape[0]}x{shape[1]} (an adapter for another base model?)."
            )
        modules.append((module, shape))
    return AdapterInfo(
        digest=adapter.digest,
        rank=adapter.rank,
        scaling=adapter.scaling,
        modules=tuple(modules),
        files=adapter.files,
    )


def write_snapshot(info: AdapterInfo, directory: Path) -> str:
    """Write the bytes ``info``'s digest covers to ``directory/<digest>`` (once) and return
    that path: what the runner loads, so the weights it serves are the ones the digest (and so
    the prefix-cache key) names, whatever happens to the caller's directory afterwards."""
    target = directory / info.digest
    if not target.is_dir():
        partial = directory / f".{info.digest}.partial"
        partial.mkdir(parents=True, exist_ok=True)
        for name, data in info.files:
            (partial / name).write_bytes(data)
        os.replace(partial, target)
    return os.fspath(target)
