"""compressed-tensors checkpoints through the engine: greedy output token-identical to
transformers' model decompressed by compressed-tensors (float32) per family and scheme, with
concurrent requests and preemption; logprobs close; every targeted projection kept quantized
(no float copy); a broken checkpoint refused at start with a typed error; with
``quantized_activations="int8"`` int4 / int8 projections stay close to the exact path and fp8
ones keep float32 activations.

Qwen3-MoE checkpoints store one quantized projection per expert (``mlp.experts.E.*_proj``), the
router in float; transformers' reference stacks the decompressed experts into its fused expert
tensors at load (its compressed-tensors checkpoint conversion), which handles symmetric packed and
FP8 experts only (asymmetric experts fail there for want of a zero point), hence symmetric MoE
cases; the engine reads expert projections through the same per-layer path as dense ones."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.model.errors import CheckpointError
from asyncpaged.model.fp8_weight import FP8Weight
from asyncpaged.model.loader import load_model
from asyncpaged.model.packed_int_weight import PackedIntWeight
from asyncpaged.model.quantized_linear import QUANT_ATTR, set_activations
from asyncpaged.testing.tiny_compressed import load_transformers_compressed, write_tiny_compressed
from tests.engine.conftest import running_engine
from tests.engine.quantized_reference import PROMPTS, assert_engine_equals

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


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _kl(p: dict[int, Any], q: dict[int, Any]) -> float:
    """KL(p || q) of two top-k logprob dicts, both renormalised over their shared tokens."""
    shared = set(p) & set(q)
    lp = {t: p[t].logprob for t in shared}
    lq = {t: q[t].logprob for t in shared}
    zp = math.log(sum(math.exp(v) for v in lp.values()))
    zq = math.log(sum(math.exp(v) for v in lq.values()))
    return sum(math.exp(lp[t] - zp) * ((lp[t] - zp) - (lq[t] - zq)) for t in shared)


@pytest.mark.parametrize("scheme", ["W4A16-asym", "W8A16"])
async def test_int8_activations_are_close_not_exact(checkpoint: Any, scheme: str) -> None:
    """``quantized_activations="int8"``: every int4 / int8 projection multiplies int8
        activations (x quantized per weight group); the next-token distributions stay close to the
        exact path's (mean KL of the top-20 distributions below 0.01 over the positions where the
    two agree so far) and greedy tokens mostly agree
        (the quantization of x is the only difference)."""
    path = checkpoint("llama-gqa", scheme)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)
    runs: dict[str, list[Any]] = {}
    for mode in ("float32", "int8"):
        async with running_engine(path, num_device_blocks=32, executor_backend="thread",
                                  quantized_activations=mode) as engine:  # fmt: skip
            model = engine.runner.model if engine.runner is not None else None
            assert model is not None
            weights = [m.__dict__[QUANT_ATTR] for m in model.modules() if QUANT_ATTR in m.__dict__]
            assert weights and all(w.activations == mode for w in weights)
            runs[mode] = [(await engine.generate(p, params)).outputs[0] for p in PROMPTS]
    agree = total = 0
    kls = []
    for exact, int8 in zip(runs["float32"], runs["int8"], strict=True):
        first = _common_prefix(exact.token_ids, int8.token_ids)
        agree += first
        total += len(exact.token_ids)
        for step in range(first):  # same prefix: the same context on both sides
            kls.append(_kl(exact.logprobs[step], int8.logprobs[step]))
    print(f"{scheme}: greedy agreement {agree}/{total}, mean KL {sum(kls) / max(len(kls), 1):.2e}")
    assert agree / total >= 0.6, (agree, total)
    assert kls and sum(kls) / len(kls) < 0.01, kls
    assert runs["float32"] != runs["int8"]  # a different computation, not the same one


def test_fp8_weights_keep_float32_activations(checkpoint: Any) -> None:
    layer = load_model(checkpoint("qwen3", "FP8"), dtype="float32").get_submodule(
        "model.layers.0.self_attn.q_proj")  # fmt: skip
    assert set_activations(nn.Sequential(layer), "int8") == 0
    assert set_activations(nn.Sequential(layer), "float32") == 1
