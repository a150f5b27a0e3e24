"""Errors raised while loading a checkpoint into one of asyncpaged's model families.

AsyncPagedError
 +-- ModelLoadError (also ValueError): the checkpoint cannot be served as asked
      +-- UnsupportedModelError: an architecture, RoPE variant or dtype we do not implement
      +-- CheckpointError: missing files, missing or unexpected tensors, mismatched shapes
"""

from __future__ import annotations

from asyncpaged.errors import AsyncPagedError


class ModelLoadError(AsyncPagedError, ValueError):
    """A checkpoint directory that cannot be loaded as asked; nothing was loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint asks for something no asyncpaged model family implements."""


class CheckpointError(ModelLoadError):
    """The checkpoint's files or tensors do not match what its config.json describes."""
