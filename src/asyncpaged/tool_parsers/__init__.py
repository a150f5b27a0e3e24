"""Streaming tool-call parsers: each reads a chat reply as it is generated and splits it into
content and tool calls, exactly the same for any split of the reply into pieces.

The built-in parsers (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``) register
themselves when this package is imported; docs/tool_parsers.md describes the formats.
"""

from __future__ import annotations

from asyncpaged.tool_parsers.base import ToolParseDelta, ToolParser
from asyncpaged.tool_parsers.call_ids import mistral_call_id, random_call_id
from asyncpaged.tool_parsers.calls import calls_from_deltas, parse_tool_calls
from asyncpaged.tool_parsers.hermes import HermesToolParser
from asyncpaged.tool_parsers.llama3_json import Llama3JsonToolParser
from asyncpaged.tool_parsers.mistral import MistralToolParser
from asyncpaged.tool_parsers.pythonic import PythonicToolParser
from asyncpaged.tool_parsers.registry import (
    get_tool_parser,
    register_tool_parser,
    tool_parser_for_template,
    tool_parser_names,
)

__all__ = [
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "ToolParseDelta",
    "ToolParser",
    "calls_from_deltas",
    "get_tool_parser",
    "mistral_call_id",
    "parse_tool_calls",
    "random_call_id",
    "register_tool_parser",
    "tool_parser_for_template",
    "tool_parser_names",
]
