"""GGUF files through the engine: greedy output token-identical to transformers' dequantized
float32 model (its own GGUF reading) per family and tensor type, with concurrent requests and
preemption; logprobs close; the projections' weights kept quantized (no float copy); a broken
file refused at start with a typed error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.model.errors import GGUFError
from asyncpaged.model.quantized_linear import QUANT_ATTR
from asyncpaged.testing.tiny_gguf import load_transformers_gguf, write_tiny_gguf
from tests.engine.conftest import running_engine
from tests.engine.quantized_reference import PROMPTS, assert_engine_equals

pytestmark = pytest.mark.anyio

CASES = [
    ("llama-gqa", "Q8_0"), ("llama-gqa", "Q4_0"), ("llama-mha", "Q8_0"), ("qwen2", "Q4_0"),
    ("qwen3", "Q8_0"), ("qwen3-moe", "Q4_0"), ("llama-wide", "Q4_K"), ("llama-wide", "Q5_K"),
    ("llama-wide", "Q6_K"), ("qwen2", "F16"), ("llama-gqa", "BF16"),
]  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, qtype: str) -> Path:
        if (name, qtype) not in made:
            folder = tmp_path_factory.mktemp(f"{name}-{qtype}")
            made[name, qtype] = write_tiny_gguf(name, folder / f"{name}-{qtype}.gguf",
                                                default=qtype)  # fmt: skip
        return made[name, qtype]

    return get


@pytest.mark.parametrize(("name", "qtype"), CASES, ids=str)
async def test_greedy_equals_transformers(gguf_file: Any, name: str, qtype: str) -> None:
    path = gguf_file(name, qtype)
    model = await assert_engine_equals(path, load_transformers_gguf(path))
    quantized = [m for m in model.modules() if QUANT_ATTR in m.__dict__]
    if qtype in ("F16", "BF16"):
        assert not quantized
        assert model.quantized_head is None and model.quantized_embedding is None
    else:  # every projection kept in its blocks, its float weight empty
        assert quantized and all(m.weight.numel() == 0 for m in quantized)
        assert all(m.__dict__[QUANT_ATTR].qtype == qtype for m in quantized)
        # and the token embedding and the LM head (one table when tied): no float copy either
        head, table = model.quantized_head, model.quantized_embedding
        assert head is not None and table is not None and head.qtype == qtype
        assert (head is table) == model.tie_word_embeddings
        assert model.lm_head_weight().numel() == 0
        assert model.model.embed_tokens.weight.numel() == 0


async def test_a_truncated_file_is_refused_at_start(gguf_file: Any, tmp_path: Path) -> None:
    data = gguf_file("llama-gqa", "Q8_0").read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match=r"broken\.gguf"):
        async with AsyncEngine(EngineConfig(model=str(broken), executor_backend="thread")):
            pass


async def test_int8_activations_are_close_not_exact(gguf_file: Any) -> None:
    """``quantized_activations="int8"`` (llama.cpp's way): every GGUF weight multiplies int8
    activations; the first token's distribution stays close to the exact path's (the
    quantization of x is the only difference)."""
    path = gguf_file("llama-gqa", "Q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    firsts: dict[str, list[dict[int, float]]] = {}
    for mode in ("float32", "int8"):
        async with running_engine(path, num_device_blocks=32, executor_backend="thread",
                                  quantized_activations=mode) as engine:  # fmt: skip
            model = engine.runner.model if engine.runner is not None else None
            assert model is not None
            weights = [m.__dict__[QUANT_ATTR] for m in model.modules() if QUANT_ATTR in m.__dict__]
            assert weights and all(w.activations == mode for w in weights)
            outs = [await engine.generate(p, params) for p in PROMPTS]
        firsts[mode] = [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
    for exact, int8 in zip(firsts["float32"], firsts["int8"], strict=True):
        shared = set(exact) & set(int8)
        assert len(shared) >= 3
        assert max(abs(exact[t] - int8[t]) for t in shared) < 0.1
    assert firsts["float32"] != firsts["int8"]  # a different computation, not the same one
