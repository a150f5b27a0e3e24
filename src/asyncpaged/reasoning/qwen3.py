"""Qwen3's reasoning parser ("qwen3"): ``<think>...</think>``, thinking only when the prompt
opened it or the reply opens it.

Qwen3's hybrid templates leave ``<think>`` to the model (which writes it first) or, with
``enable_thinking=False``, put an empty ``<think>\\n\\n</think>\\n\\n`` into the prompt, so the
reply has no thinking at all; the thinking-only templates (Qwen3-2507 "Thinking") open
``<think>`` in the prompt, so the reply starts inside it (``in_reasoning=True``).
"""

from __future__ import annotations

from typing import ClassVar

from asyncpaged.reasoning.parser import ReasoningParser
from asyncpaged.reasoning.registry import register_reasoning_parser

__all__ = ["Qwen3ReasoningParser"]


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """A reply is reasoning from its start only when the prompt opened the thinking; else
    only a leading ``<think>`` opens it, and a reply without one is all content."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    @classmethod
    def reply_starts_in_reasoning(cls, in_reasoning: bool) -> bool:
        return in_reasoning
