"""A tiny, seeded Qwen3-style chat checkpoint with tool-call and thinking markup, saved as a real
HF directory: what tool calling and reasoning are tested on without downloading a model.

Its tokenizer is the byte-level BPE of ``tiny_models`` with Qwen's markers: ``<|im_start|>`` and
``<|im_end|>`` (special; ``<|im_end|>`` is the end of a turn, the model's EOS), and ``<tool_call>``,
``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` (added,
not special: a reply keeps them in its text, as Qwen's does). Its chat template follows Qwen3's:
tools in the system turn, an assistant's calls as ``<tool_call>`` JSON, tool results as a user
turn of ``<tool_response>`` blocks, ``enable_thinking=False`` writing an empty thinking block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncpaged.testing.tiny_models import (
    CORPUS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tiny_model,
)

__all__ = ["CHAT_TEMPLATE", "MARKERS", "build_tiny_chat_checkpoint", "build_tiny_chat_tokenizer"]

CHAT_SPECIAL = ("<|im_start|>", "<|im_end|>")
MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def build_tiny_chat_tokenizer() -> Any:
    """The tiny BPE (``VOCAB_SIZE`` ids in all) with Qwen's chat and tool markers; ``<|im_end|>``
    is its EOS and the template above its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS, *CHAT_SPECIAL]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKERS),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    pad, bos, _, unk = SPECIAL_TOKENS
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token="<|im_end|>", unk_token=unk
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_chat_checkpoint(directory: str | Path, seed: int = 0) -> Path:
    """Save the tiny ``qwen3`` model with the chat tokenizer into ``directory``: its EOS is
    ``<|im_end|>``, so a reply ends where a turn does; its context 4096 tokens."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_chat_tokenizer()
    model = build_tiny_model("qwen3", seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = eos
    # A tools prompt is ~900 tokens of this tiny vocabulary: room for it and a few turns.
    model.config.max_position_embeddings = 4096
    model.generation_config.eos_token_id = eos
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
