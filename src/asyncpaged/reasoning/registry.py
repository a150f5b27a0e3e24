"""The reasoning parsers by name (vLLM's ``--reasoning-parser`` names): a parser class
registers itself with :func:`register_reasoning_parser`; the engine looks its configured one up
with :func:`get_reasoning_parser`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from asyncpaged.errors import InvalidRequestError

if TYPE_CHECKING:
    from asyncpaged.reasoning.parser import ReasoningParser

__all__ = ["get_reasoning_parser", "reasoning_parser_names", "register_reasoning_parser"]

_P = TypeVar("_P", bound="type[ReasoningParser]")
_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(name: str) -> Callable[[_P], _P]:
    """A class decorator that registers a parser class under ``name`` (a name is taken once)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reasoning parser's name must be a non-empty str, got {name!r}.")

    def register(cls: _P) -> _P:
        if name in _PARSERS and _PARSERS[name] is not cls:
            raise ValueError(f"reasoning parser {name!r} is already registered.")
        _PARSERS[name] = cls
        return cls

    return register


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under ``name``; InvalidRequestError naming the known ones
    otherwise."""
    parser = _PARSERS.get(name) if isinstance(name, str) else None
    if parser is None:
        raise InvalidRequestError(
            f"unknown reasoning parser {name!r}; known: {', '.join(reasoning_parser_names())}."
        )
    return parser


def reasoning_parser_names() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_PARSERS))
