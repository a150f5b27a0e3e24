"""Which reasoning parser a chat template calls for (``EngineConfig.reasoning_parser="auto"``).

A template that writes both ``<think>`` and ``</think>`` belongs to a thinking model. If its
generation prompt (the part after its last ``add_generation_prompt`` test) ends a string with
``<think>`` and newlines, as DeepSeek-R1's ``'<｜Assistant｜><think>\\n'`` does (and QwQ-32B's and
the Qwen3-2507 thinking models'), the model always thinks: "deepseek_r1". Otherwise (Qwen3's
hybrid templates, whose generation prompt writes ``<think>`` only in the closed, empty block of
``enable_thinking=False``): "qwen3".
"""

from __future__ import annotations

import re

__all__ = ["reasoning_parser_for_template"]

# <think>, then newlines (a Jinja escape or a real one), then the end of a string literal
_OPENS_THINKING = re.compile(r"<think>(?:\\n|\n)*['\"]")


def reasoning_parser_for_template(chat_template: str | None) -> str | None:
    """The reasoning parser's name for ``chat_template`` (module docstring), or None for a
    template of a model that does not think (or no template)."""
    if not chat_template or "<think>" not in chat_template or "</think>" not in chat_template:
        return None
    at = chat_template.rfind("add_generation_prompt")
    generation_prompt = chat_template[at:] if at >= 0 else ""
    return "deepseek_r1" if _OPENS_THINKING.search(generation_prompt) else "qwen3"
