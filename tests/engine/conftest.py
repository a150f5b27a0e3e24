"""Engine-test fixtures: tiny checkpoints, the transformers oracle, and a leak-checked engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.testing.tiny_models import build_tiny_model, build_tokenizer
from tests.model.conftest import hf_reference, tiny_checkpoint

__all__ = ["hf_reference", "perturbed_draft", "running_engine", "tiny_checkpoint"]


@pytest.fixture(scope="module")
def perturbed_draft(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``perturbed_draft(name)``: tiny model ``name`` with noise (std 0.01) on every weight, so
    the draft agrees with the target often but not always."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            model = build_tiny_model(name)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.01)
            path = tmp_path_factory.mktemp(f"{name}-draft")
            model.save_pretrained(str(path))
            build_tokenizer().save_pretrained(str(path))
            built[name] = path
        return built[name]

    return get


@asynccontextmanager
async def running_engine(model: Path, **config: Any) -> AsyncIterator[AsyncEngine]:
    """An engine that, when the test body is done, must be idle with every block free."""
    config.setdefault("dtype", "float32")
    async with AsyncEngine(EngineConfig(model=str(model), **config)) as engine:
        yield engine
        with anyio.fail_after(30):
            await engine.wait_idle()
        assert_no_leaks(engine)


def assert_no_leaks(engine: AsyncEngine) -> None:
    """The leak oracle: no request left anywhere, every device and host block free."""
    stats = engine.statistics()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0), stats
    assert stats.num_free_device_blocks == stats.num_device_blocks, stats
    assert stats.num_free_host_blocks == stats.num_host_blocks, stats
    assert engine._outputs is not None and not engine._outputs.live, "request states left behind"
    assert engine._scheduler.num_request_states == 0, "scheduler records left behind"
