"""Model families, checkpoint loading, the paged KV cache, attention and the model runner."""

from asyncpaged.model.errors import CheckpointError, ModelLoadError, UnsupportedModelError
from asyncpaged.model.runner import ModelRunner, SampledToken, SequenceStep, StepPlan, StepResult
from asyncpaged.model.sampler import SamplingOptions, derive_generator_key

__all__ = [
    "CheckpointError",
    "ModelLoadError",
    "ModelRunner",
    "SampledToken",
    "SamplingOptions",
    "SequenceStep",
    "StepPlan",
    "StepResult",
    "UnsupportedModelError",
    "derive_generator_key",
]
