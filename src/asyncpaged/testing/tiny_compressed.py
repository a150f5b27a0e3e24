"""Tiny compressed-tensors checkpoints, written offline with the ``compressed_tensors`` package.

``write_tiny_compressed(name, directory, scheme)`` takes a tiny model of ``testing/tiny_models``,
attaches a quantization scheme to its linear layers (``apply_quantization_config``; the LM head is
in ``ignore``), sets each layer's scales and zero points from the weight's own min and max (what
a calibration-free min-max observer computes, through ``calculate_qparams``), compresses the model
with ``ModelCompressor`` and saves it with its config (``quantization_config``) and tokenizer:
what llm-compressor writes for a model quantized without calibration data.

Mixture-of-experts models (Qwen3-MoE) are written as llm-compressor writes them: transformers 5
holds each layer's experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I]); they are split first into one ``nn.Linear`` per expert and projection
(``mlp.experts.E.{gate,up,down}_proj``), so every expert projection is quantized and stored
under its own name, and the router (``mlp.gate``) stays in float through ``ignore``.

``load_transformers_compressed(directory)`` is the reference: transformers' own reading of the
checkpoint, decompressed by compressed-tensors at load (``CompressedTensorsConfig(dequantize=
True)``) into a dense float32 model; transformers' checkpoint conversion stacks the decompressed
per-expert projections back into its fused expert tensors.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncpaged.testing.tiny_models import build_tiny_model, build_tokenizer

__all__ = ["SCHEMES", "TinyScheme", "load_transformers_compressed", "write_tiny_compressed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyScheme:
    """A compressed-tensors weight scheme for the tiny models: ``weights`` and
    ``input_activations`` are ``QuantizationArgs`` keyword arguments; ``scale_dtype`` is the dtype
    the scales are stored in (the model's dtype, in llm-compressor); ``quantize_lm_head``: the
    LM head too (it is in ``ignore`` otherwise)."""

    format: str
    weights: dict[str, Any]
    input_activations: dict[str, Any] | None = None
    scale_dtype: torch.dtype = torch.float32
    quantize_lm_head: bool = False


_FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
SCHEMES: dict[str, TinyScheme] = {
    "W4A16": TinyScheme(format="pack-quantized", weights={
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}),
    "W4A16-asym": TinyScheme(format="pack-quantized", weights={
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}),
    "W4A16-asym-bf16": TinyScheme(format="pack-quantized", weights={
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": False},
        scale_dtype=torch.bfloat16),
    "W4A16-channel-f16": TinyScheme(format="pack-quantized", weights={
        "num_bits": 4, "type": "int", "strategy": "channel", "symmetric": True},
        scale_dtype=torch.float16),
    "W8A16": TinyScheme(format="pack-quantized", weights={
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}),
    "W8A16-asym-g32": TinyScheme(format="pack-quantized", weights={
        "num_bits": 8, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
        scale_dtype=torch.bfloat16),
    "FP8": TinyScheme(format="float-quantized", weights={
        "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}),
    "FP8_DYNAMIC": TinyScheme(format="float-quantized", weights={
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        input_activations=_FP8_TOKEN, scale_dtype=torch.bfloat16),
    "FP8_BLOCK": TinyScheme(format="float-quantized", weights={
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [32, 32],
        "symmetric": True}),
}  # fmt: skip


def _min_max(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's min and max per scale: [N, G] (group), [N, 1] (channel), [1] (tensor) or
    [ceil(N/bh), ceil(K/bw)] (block)."""
    rows, cols = weight.shape
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy == "group":
        grouped = weight.reshape(rows, cols // args.group_size, args.group_size)
        return grouped.amin(-1), grouped.amax(-1)
    if strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    if strategy == "tensor":
        return weight.min().reshape(1), weight.max().reshape(1)
    if strategy == "block":
        bh, bw = args.block_structure
        nr, nc = -(-rows // bh), -(-cols // bw)
        padded = torch.zeros(nr * bh, nc * bw)
        padded[:rows, :cols] = weight
        blocks = padded.reshape(nr, bh, nc, bw).transpose(1, 2).reshape(nr, nc, -1)
        return blocks.amin(-1), blocks.amax(-1)
    raise ValueError(f"no tiny min-max for strategy {strategy!r}.")


class _Expert(torch.nn.Module):
    """One expert's projections as separate linears (the per-expert checkpoint layout)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
            self.add_module(name, layer)


def _split_experts(model: torch.nn.Module) -> bool:
    """Replace every fused expert block (``gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I], gate rows first) by a ``ModuleList`` of per-expert linears; whether any was."""
    fused = [(name, m) for name, m in model.named_modules() if hasattr(m, "gate_up_proj")]
    for name, module in fused:
        parent_name, _, attr = name.rpartition(".")
        gate, up = module.gate_up_proj.detach().chunk(2, dim=1)
        down = module.down_proj.detach()
        experts = torch.nn.ModuleList(
            _Expert(gate[e], up[e], down[e]) for e in range(gate.shape[0])
        )
        setattr(model.get_submodule(parent_name), attr, experts)
    return bool(fused)


def write_tiny_compressed(name: str, directory: str | Path, scheme: str | TinyScheme,
                          seed: int = 0) -> Path:  # fmt: skip
    """Write tiny model ``name`` quantized with ``scheme`` (a key of ``SCHEMES`` or a
    ``TinyScheme``) as a compressed-tensors checkpoint directory; returns it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    tiny = SCHEMES[scheme] if isinstance(scheme, str) else scheme
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(name, seed)
    has_experts = _split_experts(model)
    activations = tiny.input_activations
    group = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**tiny.weights),
        input_activations=None if activations is None else QuantizationArgs(**activations),
    )
    ignore = [] if tiny.quantize_lm_head else ["lm_head"]
    if has_experts:
        ignore.append(r"re:.*mlp\.gate$")
    config = QuantizationConfig(config_groups={"group_0": group}, ignore=ignore)
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            quant = getattr(module, "quantization_scheme", None)
            if quant is None or not isinstance(module, torch.nn.Linear):
                continue
            low, high = _min_max(module.weight.float(), quant.weights)
            scale, zero_point = calculate_qparams(low, high, quant.weights)
            scale = scale.to(tiny.scale_dtype)
            module.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point = torch.nn.Parameter(
                    zero_point.to(module.weight_zero_point.dtype), requires_grad=False)  # fmt: skip
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=tiny.format)
    compressor.compress_model(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(path))
    compressor.update_config(str(path))
    build_tokenizer().save_pretrained(str(path))
    return path


def load_transformers_compressed(directory: str | Path) -> Any:
    """transformers' reading of the checkpoint, decompressed at load by compressed-tensors into
    a dense float32 model (eval mode)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with warnings.catch_warnings():  # "the quantization_config from the model will be used"
        warnings.simplefilter("ignore", UserWarning)
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(dequantize=True),
        )  # fmt: skip
    return model.eval()  # type: ignore[no-untyped-call]


def quantization_config(directory: str | Path) -> dict[str, Any]:
    """The ``quantization_config`` of the checkpoint's config.json."""
    config: dict[str, Any] = json.loads((Path(directory) / "config.json").read_text())
    return dict(config["quantization_config"])
