"""Engine-test fixtures: tiny checkpoints, the transformers oracle, and a leak-checked engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from asyncpaged import AsyncEngine, EngineConfig
from tests.model.conftest import hf_reference, tiny_checkpoint

__all__ = ["hf_reference", "running_engine", "tiny_checkpoint"]


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
    assert engine._scheduler.num_tracked == 0, "scheduler records left behind"
