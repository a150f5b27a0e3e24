"""The tool parsers by name, and the parser a chat template implies."""

from __future__ import annotations

import re
from collections.abc import Callable

from asyncpaged.errors import InvalidRequestError
from asyncpaged.tool_parsers.base import ToolParser

__all__ = [
    "get_tool_parser",
    "register_tool_parser",
    "tool_parser_for_template",
    "tool_parser_names",
]

_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """A class decorator that makes a :class:`ToolParser` subclass known as ``name`` (a later
    registration under the same name replaces the earlier one)."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; InvalidRequestError names the known ones."""
    try:
        return _PARSERS[name]
    except KeyError:
        known = ", ".join(tool_parser_names())
        raise InvalidRequestError(f"Unknown tool parser {name!r}; known: {known}.") from None


def tool_parser_names() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_PARSERS))


# Markup that only one format uses, and how it shows in a chat template.
_SPECIFIC = (
    ("hermes", re.compile(re.escape("<tool_call>"))),
    ("mistral", re.compile(re.escape("[TOOL_CALLS]"))),
    # a list of calls with keyword arguments, as pythonic templates describe the format
    ("pythonic", re.compile(r"\[\s*[A-Za-z_]\w*\(\s*[A-Za-z_]\w*\s*=")),
)
# Llama 3.1/3.2's JSON calls: '"parameters": ' in the call format, or the python tag.
_LLAMA3_JSON = re.compile(r"\"parameters\"\s*:|<\|python_tag\|>")


def tool_parser_for_template(chat_template: str | None) -> str | None:
    """The tool parser a chat template's markup implies, or None when it is not clear (no
    template, no tool-call markup, or the markup of more than one format)."""
    if not chat_template:
        return None
    found = {name for name, pattern in _SPECIFIC if pattern.search(chat_template)}
    if len(found) == 1:
        return found.pop()
    if not found and _LLAMA3_JSON.search(chat_template):
        return "llama3_json"
    return None
