"""A reasoning parser's markers as one tokenizer's token ids: what the engine watches a
sequence's tokens for, and appends, for ``SamplingParams.thinking_token_budget``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncpaged.errors import InvalidRequestError
from asyncpaged.reasoning.parser import ReasoningParser

__all__ = ["ReasoningMarkers"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasoningMarkers:
    """The engine's reasoning parser with its start and end markers tokenized
    (``tokenizer.encode(marker, add_special_tokens=False)``; one id each where the tokenizer
    has the marker as a token, as Qwen3's and DeepSeek-R1's do)."""

    parser: type[ReasoningParser]
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, parser: type[ReasoningParser], tokenizer: Any) -> ReasoningMarkers:
        """Tokenize ``parser``'s markers; InvalidRequestError if one encodes to nothing."""
        start = tuple(int(t) for t in tokenizer.encode(parser.start, add_special_tokens=False))
        end = tuple(int(t) for t in tokenizer.encode(parser.end, add_special_tokens=False))
        if not start or not end:
            raise InvalidRequestError(
                f"the tokenizer encodes the reasoning markers {parser.start!r} and "
                f"{parser.end!r} to no tokens."
            )
        return cls(parser=parser, start_ids=start, end_ids=end)
