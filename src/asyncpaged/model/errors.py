"""Errors raised while loading a checkpoint into one of asyncpaged's model families.

AsyncPagedError
 +-- ModelLoadError (also ValueError): the checkpoint cannot be served as asked
      +-- UnsupportedModelError: an architecture, RoPE variant or dtype we do not implement
      +-- CheckpointError: missing files, missing or unexpected tensors, mismatched shapes
           +-- GGUFError: a malformed GGUF file (truncated, bad offsets or sizes, metadata of
                the wrong type, a broken split set); the message names the file and the tensor
                or key. An unsupported tensor type or architecture is an UnsupportedModelError.
"""

from __future__ import annotations

from asyncpaged.errors import AsyncPagedError


class ModelLoadError(AsyncPagedError, ValueError):
    """A checkpoint directory that cannot be loaded as asked; nothing was loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint asks for something no asyncpaged model family implements."""


class CheckpointError(ModelLoadError):
    """The checkpoint's files or tensors do not match what its config.json describes."""


class GGUFError(CheckpointError):
    """A GGUF file (or split set) whose bytes do not form a valid GGUF checkpoint.

    Raised while the file is opened, before any tensor byte is handed out; the message names the
    file, the tensor or metadata key, and what is wrong."""
