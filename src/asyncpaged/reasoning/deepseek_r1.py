"""DeepSeek-R1's reasoning parser ("deepseek_r1"): the model always thinks, and every reply
starts inside ``<think>``.

DeepSeek-R1's template writes ``<think>\\n`` into the generation prompt (its first release left
it to the model, which sometimes skipped it), so a reply is reasoning up to its ``</think>``, and
a reply with no ``</think>`` at all is all reasoning, whether or not the prompt was seen to open
the thinking: vLLM's ``DeepSeekR1ReasoningParser`` reads replies the same way. A reply that
still writes ``<think>`` first (R1-0528) has it dropped. QwQ-32B and Qwen3's thinking-only
models answer the same way (their templates open ``<think>`` too).
"""

from __future__ import annotations

from typing import ClassVar

from asyncpaged.reasoning.parser import ReasoningParser
from asyncpaged.reasoning.registry import register_reasoning_parser

__all__ = ["DeepSeekR1ReasoningParser"]


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """Every reply starts inside the thinking (``in_reasoning`` is accepted and makes no
    difference)."""

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    @classmethod
    def reply_starts_in_reasoning(cls, in_reasoning: bool) -> bool:
        return True
