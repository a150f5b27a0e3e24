"""Model families and checkpoint loading: the modules a checkpoint's architecture maps to, their
layers (attention, rotary embeddings, the LM head, packed linears, mixture of experts), the
loader and the CPU plan that picks kernels for them."""

from asyncpaged.model.errors import CheckpointError, ModelLoadError, UnsupportedModelError

__all__ = ["CheckpointError", "ModelLoadError", "UnsupportedModelError"]
