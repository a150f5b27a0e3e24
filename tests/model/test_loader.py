"""Checkpoint loading: formats (single, sharded, .bin), dtypes and typed errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncpaged.model.errors import CheckpointError, ModelLoadError, UnsupportedModelError
from asyncpaged.model.loader import load_model
from asyncpaged.testing.tiny_models import build_tiny_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _hf_state(name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in build_tiny_model(name).state_dict().items()}


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_loaded_weights_equal_transformers_weights(
    name: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    model = load_model(tiny_checkpoint(name), "float32")
    ours = dict(model.named_parameters())
    hf = _hf_state(name)
    for key, tensor in ours.items():
        want = hf[key].t() if model.is_transposed_checkpoint_key(key) else hf[key]
        assert torch.equal(tensor, want), key
    assert not any(p.requires_grad for p in model.parameters())


def test_sharded_safetensors_load(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny_checkpoint("qwen2")
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(dst / file))
        weight_map.update(dict.fromkeys(keys, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(dst, "float32")
    assert torch.equal(model.get_parameter("model.norm.weight"), state["model.norm.weight"])

    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing .*model-00002-of-00002\.safetensors"):
        load_model(dst, "float32")


def test_pytorch_bin_fallback(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    dst = _copy(tiny_checkpoint("opt"), tmp_path / "bin")
    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    torch.save(state, dst / "pytorch_model.bin")
    model = load_model(dst, "float32")
    key = "model.decoder.layers.1.fc2.weight"
    assert torch.equal(model.get_parameter(key), state[key])


@pytest.mark.parametrize(
    ("requested", "stored", "expected"),
    [
        ("float32", "bfloat16", torch.float32),
        ("bfloat16", "float32", torch.bfloat16),
        ("float16", "float32", torch.float16),
        ("auto", "float32", torch.float32),
        ("auto", "bfloat16", torch.float32),  # half precision becomes float32 on CPU
        ("auto", "float16", torch.float32),
    ],
)
def test_dtype_resolution(
    requested: str,
    stored: str,
    expected: torch.dtype,
    tiny_checkpoint: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    dst = _copy(tiny_checkpoint("llama-gqa"), tmp_path / "ckpt")
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = stored
    (dst / "config.json").write_text(json.dumps(config))
    model = load_model(dst, requested)
    assert {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize(
    ("requested", "stored", "logged"),
    [("auto", "bfloat16", True), ("auto", "float16", True), ("auto", "float32", False),
     ("float32", "bfloat16", False), ("bfloat16", "bfloat16", False)],
)  # fmt: skip
def test_a_half_precision_checkpoint_widened_on_cpu_is_logged(
    requested: str, stored: str, logged: bool, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """dtype "auto" loads 16-bit weights as float32 on a CPU (exact); the engine says so once,
    at INFO, naming the faster inexact opt-in; an explicit dtype or float32 weights say nothing."""
    from structlog.testing import capture_logs
    from transformers import AutoConfig

    from asyncpaged import EngineConfig
    from asyncpaged.engine.build import plan_model

    hf_config = AutoConfig.from_pretrained(str(tiny_checkpoint("llama-gqa")))
    hf_config.dtype = getattr(torch, stored)
    with capture_logs() as logs:
        plan = plan_model(EngineConfig(model="m", dtype=requested), hf_config)
    events = [e for e in logs if e["event"] == "dtype_auto"]
    assert plan.dtype == (torch.float32 if requested == "auto" else getattr(torch, requested))
    assert len(events) == logged
    if logged:
        assert events[0]["log_level"] == "info"
        assert events[0]["stored"] == stored and events[0]["loaded"] == "float32"
        assert "dtype='bfloat16'" in events[0]["hint"]


def test_unknown_dtype_is_rejected(tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(UnsupportedModelError, match="dtype must be one of"):
        load_model(tiny_checkpoint("llama-gqa"), "float8")


def test_unsupported_architecture(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    dst = _copy(tiny_checkpoint("llama-gqa"), tmp_path / "ckpt")
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"LlamaForSequenceClassification.*not supported"
    ):
        load_model(dst)


def test_unsupported_rope_type(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    dst = _copy(tiny_checkpoint("llama-gqa"), tmp_path / "ckpt")
    config = json.loads((dst / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "fancy", "rope_theta": 10000.0, "factor": 2.0}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope_type 'fancy'"):
        load_model(dst)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(tmp_path)


def test_missing_weights_file(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    dst = _copy(tiny_checkpoint("gpt2"), tmp_path / "ckpt")
    (dst / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no weights in .*expected model\.safetensors"):
        load_model(dst)


def _edit_weights(dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))


def test_shape_mismatch(tiny_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    dst = _copy(tiny_checkpoint("llama-gqa"), tmp_path / "ckpt")
    key = "model.layers.0.self_attn.k_proj.weight"

    def shrink(state: dict[str, torch.Tensor]) -> None:
        state[key] = state[key][:16].clone()

    _edit_weights(dst, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(16, 64\).*\(32, 64\)"):
        load_model(dst)


def test_missing_and_unexpected_tensors(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    dst = _copy(tiny_checkpoint("opt"), tmp_path / "ckpt")

    def rename(state: dict[str, torch.Tensor]) -> None:
        state["model.decoder.layers.0.fc9.weight"] = state.pop("model.decoder.layers.0.fc1.weight")

    _edit_weights(dst, rename)
    with pytest.raises(
        CheckpointError, match=r"missing tensors \['model\.decoder\.layers\.0\.fc1\.weight'\].*fc9"
    ):
        load_model(dst)


def test_errors_are_value_errors() -> None:
    assert issubclass(CheckpointError, ModelLoadError)
    assert issubclass(UnsupportedModelError, ValueError)
