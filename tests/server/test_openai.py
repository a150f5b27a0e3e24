"""The OpenAI endpoints through the official ``openai`` client: completions and chat, streamed
and not, n > 1, logprobs, stop strings, seeds, JSON schemas, against transformers' tokens."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.model.reference import HFReference
from tests.server.conftest import MODEL_NAME, Live, builtin_model

PROMPT = "The return statement"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ann", "bob", "carl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def reference() -> HFReference:
    return HFReference(builtin_model())


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(builtin_model()))


def test_models_lists_the_served_name(live: Live) -> None:
    assert [m.id for m in live.client().models.list()] == [MODEL_NAME]


def test_greedy_completion_equals_transformers(
    live: Live, reference: HFReference, tokenizer: Any
) -> None:
    ids = tuple(tokenizer.encode(PROMPT))
    want_tokens, want_logprobs = reference.generate(ids, 24)
    out = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(want_tokens, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want_tokens]
    for top, chosen in zip(choice.logprobs.top_logprobs or [], choice.logprobs.tokens or [],
                           strict=True):  # fmt: skip
        assert chosen in top and len(top) == 2  # greedy: the chosen token is the most likely
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 24)
    # the same prompt as token ids gives the same text
    again = live.client().completions.create(
        model=MODEL_NAME, prompt=list(ids), max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert again.choices[0].text == choice.text


def _stream_completion(live: Live, **kwargs: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in live.client().completions.create(model=MODEL_NAME, stream=True, **kwargs):
        if not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_streamed_completion_deltas_concatenate_to_the_non_streamed_text(live: Live) -> None:
    kwargs: dict[str, Any] = {"prompt": [PROMPT, "A class definition"], "n": 3,
                              "max_tokens": 20, "temperature": 0.9, "seed": 11}  # fmt: skip
    full = live.client().completions.create(model=MODEL_NAME, **kwargs)
    texts, reasons, usage = _stream_completion(
        live, stream_options={"include_usage": True}, **kwargs
    )
    assert sorted(c.index for c in full.choices) == list(range(6))
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert len({texts[0], texts[1], texts[2]}) > 1, "n samples of one seed should differ"
    assert usage is not None and full.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens,
    )  # fmt: skip


def test_streamed_chat_deltas_concatenate_to_the_non_streamed_message(live: Live) -> None:
    messages = [{"role": "user", "content": "What does the return statement do?"}]
    client = live.client()
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "n": 2, "seed": 3,
                              "max_completion_tokens": 24, "temperature": 0.8}  # fmt: skip
    full = client.chat.completions.create(**kwargs)
    texts: dict[int, str] = {}
    roles: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in full.choices}
    assert roles == {0: "assistant", 1: "assistant"}
    assert full.choices[0].message.role == "assistant"


def test_chat_logprobs_list_the_top_alternatives(live: Live) -> None:
    out = live.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Explain classes."}],
        max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy
        assert entry.logprob == pytest.approx(tops[0])
        assert entry.bytes == list(entry.token.encode())


def test_stop_string_cuts_the_text(live: Live) -> None:
    client = live.client()
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    text = plain.choices[0].text
    stop = text[12:16]
    assert stop.strip(), text
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32,
                                    temperature=0, stop=[stop])  # fmt: skip
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(live: Live) -> None:
    client = live.client()

    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                        temperature=1.0, seed=seed)  # fmt: skip
        return out.choices[0].text

    assert sample(5) == sample(5)
    assert len({sample(5), sample(6), sample(7)}) > 1


def test_json_schema_response_format_and_structured_outputs(live: Live) -> None:
    client = live.client()
    messages = [{"role": "user", "content": "Give a name and an age as JSON."}]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                "schema": SCHEMA}},
        # a weak model pads free JSON whitespace up to max_tokens: keep it compact
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), SCHEMA)
    compact = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=64, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(compact.choices[0].text), SCHEMA)
    assert compact.choices[0].finish_reason == "stop"


def test_echo_prepends_the_prompt(live: Live) -> None:
    out = live.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                           temperature=0, echo=True)  # fmt: skip
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_too_long_prompt_is_a_bad_request(live: Live, stream: bool) -> None:
    client = live.client()
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL_NAME, prompt="word " * 600, max_tokens=4,
                                  stream=stream)  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "word " * 600}],
            max_tokens=4, stream=stream,
        )  # fmt: skip


def test_unknown_model_is_not_found(live: Live) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        live.client().completions.create(model="gpt-nope", prompt=PROMPT, max_tokens=2)
