"""Model-test fixtures: tiny checkpoints built once per session, transformers references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from tests.model.reference import HFReference


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(name)`` -> directory of that tiny model, built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_reference(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], HFReference]:
    """``hf_reference(name)`` -> transformers' own greedy generation for that checkpoint."""
    made: dict[str, HFReference] = {}

    def get(name: str) -> HFReference:
        if name not in made:
            made[name] = HFReference(tiny_checkpoint(name))
        return made[name]

    return get


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Tiny matmuls: threads only add overhead and nondeterminism.
    torch.set_num_threads(1)
