"""Reasoning parsers: a thinking model's reply split into its reasoning and its content
(docs/api.md, "Reasoning models").

``parser.py`` holds the interface and the one state machine the parsers share; ``qwen3.py``
and ``deepseek_r1.py`` the parsers (imported here, so they are registered); ``registry.py``
the names; ``template.py`` the choice for a chat template; ``markers.py`` a parser's markers as
a tokenizer's token ids (what the engine's ``thinking_token_budget`` watches for).
"""

from asyncpaged.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from asyncpaged.reasoning.markers import ReasoningMarkers
from asyncpaged.reasoning.parser import ReasoningDelta, ReasoningParser, parse_reasoning
from asyncpaged.reasoning.qwen3 import Qwen3ReasoningParser
from asyncpaged.reasoning.registry import (
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)
from asyncpaged.reasoning.template import reasoning_parser_for_template

__all__ = [
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningMarkers",
    "ReasoningParser",
    "get_reasoning_parser",
    "parse_reasoning",
    "reasoning_parser_for_template",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
