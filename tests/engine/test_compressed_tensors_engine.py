"""compressed-tensors checkpoints through the engine: greedy output token-identical to
transformers' model decompressed by compressed-tensors (float32) per family and scheme, with
concurrent requests and preemption; logprobs close; every targeted projection kept quantized
(no float copy); a broken checkpoint refused at start with a typed error.

Qwen3-MoE checkpoints store one quantized projection per expert (``mlp.experts.E.*_proj``), the
router in float; transformers' reference stacks the decompressed experts into its fused expert
tensors at load (its compressed-tensors checkpoint conversion), which handles symmetric packed and
FP8 experts only (asymmetric experts fail there for want of a zero point), hence symmetric MoE
cases; the engine reads expert projections through the same per-layer path as dense ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.model.errors import CheckpointError
from asyncpaged.model.fp8_weight import FP8Weight
from asyncpaged.model.packed_int_weight import PackedIntWeight
from asyncpaged.model.quantized_linear import QUANT_ATTR
from asyncpaged.testing.tiny_compressed import load_transformers_compressed, write_tiny_compressed
from tests.engine.quantized_reference import assert_engine_equals

pytestmark = pytest.mark.anyio

CASES = [
    ("llama-gqa", "W4A16"), ("llama-gqa", "W4A16-asym"), ("qwen3", "W4A16-asym-bf16"),
    ("qwen2", "W4A16-channel-f16"), ("qwen2", "W8A16"), ("llama-gqa", "W8A16-asym-g32"),
    ("qwen3", "FP8"), ("llama-gqa", "FP8_DYNAMIC"), ("qwen2", "FP8_BLOCK"),
    ("qwen3-moe", "W4A16"), ("qwen3-moe", "FP8"),
]  # fmt: skip
#: quantized projections per layer: attention's 4 plus the MLP's 3 (one MLP, or 8 experts)
PROJECTIONS_PER_LAYER = {"qwen3-moe": 4 + 8 * 3}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, scheme: str) -> Path:
        if (name, scheme) not in made:
            folder = tmp_path_factory.mktemp(f"{name}-{scheme}")
            made[name, scheme] = write_tiny_compressed(name, folder, scheme)
        return made[name, scheme]

    return get


@pytest.mark.parametrize(("name", "scheme"), CASES, ids=str)
async def test_greedy_equals_transformers(checkpoint: Any, name: str, scheme: str) -> None:
    path = checkpoint(name, scheme)
    model = await assert_engine_equals(path, load_transformers_compressed(path))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = [m for m in linears if QUANT_ATTR in m.__dict__]
    # every projection kept quantized, its float weight empty; the LM head (and a router) in float
    per_layer = PROJECTIONS_PER_LAYER.get(name, 4 + 3)
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(quantized) == per_layer * 2 == len(linears) - 1 - len(routers)
    assert all(QUANT_ATTR not in m.__dict__ for m in routers)
    assert all(m.weight.numel() == 0 for m in quantized)
    kind = FP8Weight if scheme.startswith("FP8") else PackedIntWeight
    assert all(isinstance(m.__dict__[QUANT_ATTR], kind) for m in quantized)


async def test_a_bad_scale_shape_is_refused_at_start(checkpoint: Any, tmp_path: Path) -> None:
    source = checkpoint("llama-gqa", "W4A16")
    for f in source.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"down_proj\.weight_scale has shape"):
        async with AsyncEngine(EngineConfig(model=str(tmp_path), executor_backend="thread")):
            pass
