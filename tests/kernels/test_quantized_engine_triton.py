"""Quantized checkpoints through the engine on the Triton kernels: under the interpreter, every
quantized weight forced onto them (``use_triton``) gives the CPU kernels' greedy tokens; on CUDA
(``ASYNCPAGED_KERNELS_NATIVE=1``, ``scripts/gpu_check.sh``) a GGUF Q8_0 / Q4_K and a
compressed-tensors W4A16 checkpoint give transformers' tokens and logprobs, with preemption."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.model.fp8_weight import FP8Weight
from asyncpaged.model.gguf_weight import GGUFWeight
from asyncpaged.model.packed_int_weight import PackedIntWeight
from asyncpaged.model.quantized_linear import QUANT_ATTR
from asyncpaged.testing.tiny_compressed import load_transformers_compressed, write_tiny_compressed
from asyncpaged.testing.tiny_gguf import load_transformers_gguf, write_tiny_gguf
from tests.engine.quantized_reference import assert_engine_equals
from tests.kernels.conftest import NATIVE

PROMPTS = ([5, 6, 7, 8, 9], [11, 12, 13])


def _write(kind: str, name: str, folder: Path) -> Path:
    if kind in ("Q8_0", "Q4_K"):
        return write_tiny_gguf(name, folder / f"{name}-{kind}.gguf", default=kind)
    return write_tiny_compressed(name, folder, kind)


def _quantized_weights(model: Any) -> list[Any]:
    weights = [m.__dict__[QUANT_ATTR] for m in model.modules() if QUANT_ATTR in m.__dict__]
    head = model.quantized_head
    return weights + ([] if head is None else [head])


async def _greedy(path: Path) -> tuple[list[list[int]], list[Any]]:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    config = EngineConfig(model=str(path), dtype="float32", executor_backend="thread",
                          num_device_blocks=16)  # fmt: skip
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    async with AsyncEngine(config) as engine:

        async def one(i: int) -> None:
            tokens[i] = (await engine.generate(PROMPTS[i], params)).outputs[0].token_ids

        async with anyio.create_task_group() as tg:  # one batch: fewer interpreted steps
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        assert engine.runner is not None
        return tokens, _quantized_weights(engine.runner.model)


@pytest.mark.skipif(NATIVE, reason="forces the interpreted kernels onto CPU tensors")
@pytest.mark.parametrize(("kind", "name"), [("Q8_0", "llama-mha"), ("W4A16", "llama-gqa")])
def test_triton_weights_give_the_cpu_kernels_tokens(
    kind: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-mha ties its embedding to the head: the lookup and the head both run in Triton."""
    path = _write(kind, name, tmp_path)
    want, cpu_weights = anyio.run(_greedy, path)
    assert cpu_weights and not any(w.use_triton for w in cpu_weights)
    for cls in (GGUFWeight, PackedIntWeight, FP8Weight):
        to = cls.to

        def forced(self: Any, device: torch.device, to: Any = to) -> Any:
            moved = to(self, device)
            moved.use_triton = True
            return moved

        monkeypatch.setattr(cls, "to", forced)
    got, triton_weights = anyio.run(_greedy, path)
    assert triton_weights and all(w.use_triton for w in triton_weights)
    assert got == want


@pytest.mark.skipif(not NATIVE, reason="needs CUDA (scripts/gpu_check.sh)")
@pytest.mark.parametrize(("kind", "name"), [("Q8_0", "llama-gqa"), ("Q4_K", "llama-wide"),
                                            ("W4A16", "llama-gqa")])  # fmt: skip
def test_cuda_engine_equals_transformers(kind: str, name: str, tmp_path: Path) -> None:
    path = _write(kind, name, tmp_path)
    load = load_transformers_gguf if kind.startswith("Q") else load_transformers_compressed
    model = anyio.run(functools.partial(assert_engine_equals, path, load(path), device="cuda"))
    weights = _quantized_weights(model)
    assert weights and all(w.use_triton for w in weights)
