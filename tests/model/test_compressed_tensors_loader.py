"""Loading compressed-tensors checkpoints: weights equal transformers' decompressed ones bit for
bit and stay quantized; a quantized LM head is dequantized; every scheme asyncpaged does not run,
and every malformed tensor, is refused at load with a typed error naming the field or tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncpaged.model.base import TensorShard
from asyncpaged.model.compressed_tensors_scheme import dequantize_weight
from asyncpaged.model.errors import CheckpointError, UnsupportedModelError
from asyncpaged.model.loader import load_model
from asyncpaged.model.quantized_linear import QUANT_ATTR
from asyncpaged.testing.tiny_compressed import (
    SCHEMES,
    TinyScheme,
    load_transformers_compressed,
    write_tiny_compressed,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(scheme: str) -> Path:
        if scheme not in made:
            made[scheme] = write_tiny_compressed("llama-gqa", tmp_path_factory.mktemp(scheme),
                                                 scheme)  # fmt: skip
        return made[scheme]

    return get


def _copy(source: Path, target: Path) -> Path:
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_weights_are_transformers_decompressed_bit_for_bit(checkpoint: Any, scheme: str) -> None:
    path = checkpoint(scheme)
    model = load_model(path, dtype="float32")
    reference = load_transformers_compressed(path)
    count = 0
    for name, module in model.named_modules():
        weight = module.__dict__.get(QUANT_ATTR)
        if weight is None:
            continue
        want = reference.get_submodule(name).weight.detach()
        assert torch.equal(dequantize_weight(weight), want), name
        assert weight.nbytes < want.numel() * 2  # codes and scales, not a float copy
        count += 1
    assert count == 14


def test_a_quantized_lm_head_is_dequantized(tmp_path: Path) -> None:
    base = SCHEMES["W8A16"]
    path = write_tiny_compressed("qwen2", tmp_path, TinyScheme(format=base.format,
                                 weights=base.weights, quantize_lm_head=True))  # fmt: skip
    assert "lm_head.weight_packed" in load_file(str(path / "model.safetensors"))
    model = load_model(path, dtype="float32")
    reference = load_transformers_compressed(path)
    assert QUANT_ATTR not in model.lm_head.__dict__
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


CONFIG_EDITS: dict[str, tuple[str, Callable[[dict[str, Any]], None]]] = {
    "num_bits": ("weights.num_bits", lambda q: q["config_groups"]["group_0"]["weights"].update(
        num_bits=2)),
    "strategy": ("weights.strategy", lambda q: q["config_groups"]["group_0"]["weights"].update(
        strategy="tensor_group")),
    "group_size": ("weights.group_size", lambda q: q["config_groups"]["group_0"]["weights"].update(
        group_size=48)),
    "actorder": ("actorder", lambda q: q["config_groups"]["group_0"]["weights"].update(
        actorder="group")),
    "int8 activations": ("input_activations", lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True})),
    "static fp8 activations": ("input_activations", lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float", "strategy": "tensor"})),
    "output activations": ("output_activations", lambda q: q["config_groups"]["group_0"].update(
        output_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})),
    "format": ("format", lambda q: q["config_groups"]["group_0"].update(format="marlin-24")),
    "status": ("quantization_status", lambda q: q.update(quantization_status="frozen")),
    "kv cache": ("kv_cache_scheme", lambda q: q.update(
        kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})),
    "quant method": ("quant_method", lambda q: q.update(quant_method="gptq")),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(CONFIG_EDITS))
def test_unsupported_schemes_are_refused_naming_the_field(checkpoint: Any, tmp_path: Path,
                                                          what: str) -> None:  # fmt: skip
    field, edit = CONFIG_EDITS[what]
    path = _copy(checkpoint("W4A16-asym"), tmp_path)
    _edit_config(path, edit)
    with pytest.raises(UnsupportedModelError, match=field):
        load_model(path, dtype="float32")


def _set(
    name: str, value: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[dict[str, Any]], None]:
    def edit(tensors: dict[str, Any]) -> None:
        tensors[name] = value(tensors[name]).contiguous()

    return edit


LAYER = "model.layers.0.self_attn.o_proj"
TENSOR_EDITS: dict[str, tuple[str, str, Callable[[dict[str, Any]], None]]] = {
    "scale shape": ("W4A16-asym", "weight_scale has shape", _set(f"{LAYER}.weight_scale",
                                                                lambda t: t[:, :1])),
    "scale dtype": ("W4A16-asym", "weight_scale has dtype", _set(f"{LAYER}.weight_scale",
                                                                lambda t: t.double())),
    "packed shape": ("W4A16-asym", "weight_packed has shape", _set(f"{LAYER}.weight_packed",
                                                                  lambda t: t[:, :-1])),
    "packed dtype": ("W4A16-asym", "weight_packed has dtype", _set(f"{LAYER}.weight_packed",
                                                                  lambda t: t.to(torch.int64))),
    "zero point shape": ("W4A16-asym", "weight_zero_point has shape",
                         _set(f"{LAYER}.weight_zero_point", lambda t: t[:1])),
    "weight_shape": ("W8A16", "weight_shape is", _set(f"{LAYER}.weight_shape",
                                                     lambda t: t + 32)),
    "fp8 dtype": ("FP8", "weight has dtype", _set(f"{LAYER}.weight", lambda t: t.float())),
    "fp8 block scales": ("FP8_BLOCK", "weight_scale has shape", _set(f"{LAYER}.weight_scale",
                                                                    lambda t: t[:1])),
    "missing zero point": ("W4A16-asym", "lacks", lambda t: t.pop(f"{LAYER}.weight_zero_point")),
    "a float weight left": ("W8A16", "unexpected tensors", lambda t: t.update(
        {f"{LAYER}.weight_g_idx": torch.zeros(64, dtype=torch.int32)})),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(TENSOR_EDITS))
def test_malformed_tensors_are_refused(checkpoint: Any, tmp_path: Path, what: str) -> None:
    scheme, match, edit = TENSOR_EDITS[what]
    path = _copy(checkpoint(scheme), tmp_path)
    _edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(path, dtype="float32")


def test_tensor_parallelism_and_devices_without_kernels_are_refused(checkpoint: Any) -> None:
    """Quantized weights multiply on the CPU or on CUDA (Triton), on one rank."""
    path = checkpoint("W4A16")
    shard = TensorShard(rank=0, world_size=2, all_reduce=lambda t: None)
    with pytest.raises(UnsupportedModelError, match="no tensor parallelism"):
        load_model(path, dtype="float32", shard=shard)
    with pytest.raises(UnsupportedModelError, match="runs on the CPU or CUDA, not on 'meta'"):
        load_model(path, dtype="float32", device="meta")
