"""asyncpaged: an LLM inference engine for your own event loop, on a paged KV cache."""

from asyncpaged.config import EngineConfig
from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.engine.llm import LLM
from asyncpaged.engine.stats import EngineStatistics
from asyncpaged.errors import (
    AsyncPagedError,
    BlockPoolError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    NoTokenAllowedError,
    RequestFailedError,
    WorkerDiedError,
)
from asyncpaged.inputs import PromptType, TextPrompt, TokensPrompt
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.lora_request import LoRARequest
from asyncpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from asyncpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from asyncpaged.spec_decode import SpeculativeConfig
from asyncpaged.streams import RequestStream
from asyncpaged.structured_outputs import StructuredOutputsParams
from asyncpaged.versions import __version__

__all__ = [
    "LLM",
    "AsyncEngine",
    "AsyncPagedError",
    "BeamSearchParams",
    "BlockPool",
    "BlockPoolError",
    "CompletionOutput",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStatistics",
    "InvalidRequestError",
    "LoRARequest",
    "Logprob",
    "NoTokenAllowedError",
    "PromptType",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStream",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "WorkerDiedError",
    "__version__",
]
