"""``check_messages``: OpenAI's chat messages made ready for a chat template (content parts
flattened, tool calls' arguments parsed), and the shapes it refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from asyncpaged import EngineConfig, InvalidRequestError
from asyncpaged.inputs import check_messages

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"city": "Paris", "days": 2}'}}  # fmt: skip


def test_text_parts_are_joined_with_newlines() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    out = check_messages([{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                          {"role": "user", "content": parts}])  # fmt: skip
    assert out == [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "first\nsecond"}]  # fmt: skip
    assert check_messages([{"role": "user", "content": []}]) == [{"role": "user", "content": ""}]


def test_tool_calls_arguments_become_a_dict_and_the_input_is_not_changed() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sun"}]},
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": ""}}]},
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    before = copy.deepcopy(messages)
    out = check_messages(messages)
    assert messages == before
    assert out[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "lookup", "arguments": {"city": "Paris", "days": 2}}}]  # fmt: skip
    assert out[1]["content"] is None
    assert out[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sun"}
    assert out[3]["tool_calls"][0]["function"]["arguments"] == {}  # vLLM: empty -> {}
    assert "tool_calls" not in out[4]  # an empty list is dropped, as vLLM does


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
         "takes text only"),
        ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
         "takes text only"),
        ({"role": "user", "content": [{"type": "text"}]}, "str 'text'"),
        ({"role": "user", "content": ["bare"]}, "str 'type'"),
        ({"role": "user", "content": 3}, "str or a list of parts"),
        ({"role": "tool", "content": "42"}, "tool_call_id"),
        ({"role": "tool", "content": "42", "tool_call_id": 7}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "only assistant"),
        ({"role": "assistant", "tool_calls": CALL}, "must be a list"),
        ({"role": "assistant", "tool_calls": ["call"]}, "must be a dict"),
        ({"role": "assistant", "tool_calls": [{**CALL, "id": None}]}, "str 'id'"),
        ({"role": "assistant", "tool_calls": [{**CALL, "type": "web"}]}, "'function'"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
         "str 'name'"),
        ({"role": "assistant",
          "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]},
         "not valid JSON"),
        ({"role": "assistant",
          "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1, 2]"}}]},
         "JSON object"),
    ],
)  # fmt: skip
def test_bad_shapes_are_invalid_requests(message: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        check_messages([{"role": "user", "content": "hi"}, message])


def test_engine_config_takes_a_path_and_stores_a_str(tmp_path: Path) -> None:
    config = EngineConfig(model=tmp_path)
    assert config.model == str(tmp_path) and isinstance(config.model, str)
    with pytest.raises(InvalidRequestError, match="checkpoint directory"):
        EngineConfig(model=3)  # type: ignore[arg-type]
