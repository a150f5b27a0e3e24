"""The Triton backend inside the model runner: greedy tokens equal the torch backend's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from asyncpaged.kernels.backend import TritonAttentionBackend, make_attention_backend

from asyncpaged.model.attention import TorchAttentionBackend
from asyncpaged.model.runner import ModelRunner
from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from tests.kernels.conftest import NATIVE
from tests.model.driver import Driver, SimSequence
from tests.model.reference import HFReference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: build_tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        for name in ("llama-gqa", "mistral")
    }


def _sequences() -> list[SimSequence]:
    return [
        SimSequence(seq_id=0, prompt=tuple(range(5, 22)), max_new_tokens=6),  # 17: a page + 1
        SimSequence(seq_id=1, prompt=tuple(range(30, 45)), max_new_tokens=5, start_step=1),
        SimSequence(  # chunked prefill across three steps while others decode
            seq_id=2, prompt=tuple(range(50, 90)), max_new_tokens=4, chunk_sizes=(16, 9, 15)
        ),
    ]


def _generate(checkpoint: Path, backend_name: str, device: torch.device) -> list[list[int]]:
    backend = TritonAttentionBackend() if backend_name == "triton" else TorchAttentionBackend()
    runner = ModelRunner(
        checkpoint,
        "float32",
        num_blocks=64,
        device=device,
        attn_backend=backend,
        kv_fill_value=float("nan"),
    )
    seqs = _sequences()
    Driver(runner, seed=1).run(seqs)
    return [s.output for s in seqs]


@pytest.mark.parametrize("name", ["llama-gqa", "mistral"])  # mistral: sliding window 12
def test_runner_greedy_tokens_match_torch_backend(
    name: str, checkpoints: dict[str, Path], device: torch.device
) -> None:
    want = _generate(checkpoints[name], "torch", torch.device("cpu"))
    got = _generate(checkpoints[name], "triton", device)
    assert got == want


def test_runner_greedy_tokens_match_transformers(
    checkpoints: dict[str, Path], device: torch.device
) -> None:
    reference = HFReference(checkpoints["llama-gqa"])
    want = [reference.generate(s.prompt, s.max_new_tokens)[0] for s in _sequences()]
    assert _generate(checkpoints["llama-gqa"], "triton", device) == want


def test_factory_picks_by_device_and_name() -> None:
    assert isinstance(make_attention_backend("cpu"), TorchAttentionBackend)
    assert isinstance(make_attention_backend("cpu", "torch"), TorchAttentionBackend)
    if not NATIVE:  # the interpreter stands in for CUDA
        assert isinstance(make_attention_backend("cpu", "triton"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
        make_attention_backend("cpu", "flash")  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_factory_picks_triton_on_cuda() -> None:
    assert isinstance(make_attention_backend("cuda"), TritonAttentionBackend)
