"""Model families, checkpoint loading, the paged KV cache, attention and the model runner."""

from asyncpaged.model.errors import CheckpointError, ModelLoadError, UnsupportedModelError
from asyncpaged.model.runner import ModelRunner, SampledToken, SequenceStep, StepPlan, StepResult

__all__ = [
    "CheckpointError",
    "ModelLoadError",
    "ModelRunner",
    "SampledToken",
    "SequenceStep",
    "StepPlan",
    "StepResult",
    "UnsupportedModelError",
]
