"""Speculative decoding's building blocks: configuration, prompt-lookup proposals,
verification by modified rejection sampling, and statistics.

The engine wiring (scheduler, runner, actors) is not here: the runner scores ``k + 1`` query
tokens per sequence, ``sampling.rejection.verify`` picks what to keep, and
``BlockPool.truncate`` rolls the rejected slots back (see each module's docstring).

This package imports no torch: ``asyncpaged.config`` imports ``SpeculativeConfig`` from it, so
the verification math (which builds on ``asyncpaged.sampling.sampler``) is imported from
``asyncpaged.sampling.rejection`` directly.
"""

from asyncpaged.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from asyncpaged.spec_decode.ngram import (
    NgramProposer,
    TokenHistory,
    propose_ngram,
    propose_ngram_batch,
)
from asyncpaged.spec_decode.stats import SpeculativeStats

__all__ = [
    "NgramProposer",
    "SpeculativeConfig",
    "SpeculativeMethod",
    "SpeculativeStats",
    "TokenHistory",
    "propose_ngram",
    "propose_ngram_batch",
]
