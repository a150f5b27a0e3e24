"""The engine with ``attention_backend="triton"`` (under the interpreter here, native on CUDA)
gives the same greedy tokens as with the torch backend."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from tests.kernels.conftest import NATIVE


async def _run(model: Path, backend: str) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    device = "cuda" if NATIVE else "cpu"
    config = EngineConfig(model=str(model), dtype="float32", num_device_blocks=32,
                          device=device, attention_backend=backend,
                          max_num_batched_tokens=24)  # fmt: skip
    prompts = [list(range(5, 22)), list(range(30, 45)), list(range(50, 90))]
    outs: dict[int, list[int]] = {}
    async with AsyncEngine(config) as engine:
        kind = type(engine.runner.model.attn_backend).__name__
        assert kind == f"{backend.capitalize()}AttentionBackend"

        async def one(i: int) -> None:
            outs[i] = (await engine.generate(prompts[i], params)).outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        await engine.wait_idle()
    return [outs[i] for i in range(len(prompts))]


def test_engine_with_triton_backend_matches_torch_backend(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("engine-triton"))
    want = anyio.run(_run, model, "torch")
    got = anyio.run(_run, model, "triton")
    assert got == want
