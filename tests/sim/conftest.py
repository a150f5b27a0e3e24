"""Simulator-test fixtures: the tiny checkpoints of the model tests."""

from __future__ import annotations

from tests.model.conftest import tiny_checkpoint

__all__ = ["tiny_checkpoint"]
