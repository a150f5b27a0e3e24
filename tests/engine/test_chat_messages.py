"""``engine.chat`` with OpenAI's message shapes: content parts flattened and tool calls'
arguments parsed before the template, so that the prompt's ids are transformers' template on the
checked messages (a Qwen-style template iterates ``arguments`` as a mapping)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncpaged import AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from asyncpaged.inputs import check_messages

pytestmark = pytest.mark.anyio

# Qwen2.5's way with tool calls: arguments rendered with tojson, tool results in <tool_response>
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for call in m.get('tool_calls', []) %}<tool_call>{{ call['function']['name'] }}"
    "{% for k, v in call['function']['arguments'].items() %} {{ k }}={{ v | tojson }}"
    "{% endfor %}</tool_call>{% endfor %}"
    "{% if m['role'] == 'tool' %} ({{ m['tool_call_id'] }}){% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tool_model(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(tiny_checkpoint("llama-gqa"), path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": [{"type": "text", "text": "the paged"},
                                   {"type": "text", "text": "attention design"}]},
    {"role": "user", "content": [{"type": "text", "text": "blocks of memory?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"topic": "blocks", "depth": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sixteen tokens each"},
]  # fmt: skip


async def test_content_parts_and_tool_calls_render_as_transformers_renders_checked_messages(
    tool_model: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tool_model))
    checked = check_messages(MESSAGES)
    text = tokenizer.apply_chat_template(checked, tokenize=False, add_generation_prompt=True)
    assert "the paged\nattention design" in text
    assert 'lookup topic="blocks" depth=2' in text
    want = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # EngineConfig takes the Path itself
    async with AsyncEngine(EngineConfig(model=tool_model, dtype="float32")) as engine:
        out = await engine.chat(MESSAGES, params)
        assert out.prompt_token_ids == want
        assert out.prompt == text
        before = engine.statistics()
        with pytest.raises(InvalidRequestError, match="takes text only"):
            engine.chat([{"role": "user", "content": [{"type": "image_url"}]}], params)
        with pytest.raises(InvalidRequestError, match="tool_call_id"):
            engine.chat([*MESSAGES[:3], {"role": "tool", "content": "x"}], params)
        assert engine.statistics() == before  # nothing was queued
