"""What stands in front of the routes: the API key, the size limits, OpenAI's body for unknown
paths and methods, the OpenAI fields accepted and ignored, and OpenAI's message shapes (content
parts, tool calls) on their way to ``engine.chat``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient
from starlette.types import ASGIApp
from transformers import AutoTokenizer

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.inputs import check_messages
from asyncpaged.server import create_app
from tests.server.conftest import MODEL_NAME, Live, builtin_model, live_app

KEY = "sk-test-0123456789"
MAX_BYTES = 16 << 10
SERVER_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% if m['content'] %} {{ m['content'] }}{% endif %}"
    "{% for call in m.get('tool_calls', []) %} call {{ call['function']['name'] }}"
    "{% for k, v in call['function']['arguments'].items() %} {{ k }}={{ v }}{% endfor %}"
    "{% endfor %}{% if m['role'] == 'tool' %} for {{ m['tool_call_id'] }}{% endif %}\n"
    "{% endfor %}assistant:"
)
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "temperature": 0}  # fmt: skip
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded() -> Iterator[Live]:
    """A server with an API key, small limits and a chat template of its own."""
    config = EngineConfig(model=builtin_model(), dtype="float32")

    def make(engine: AsyncEngine | None) -> ASGIApp:
        assert engine is not None
        return create_app(engine, served_model_name=MODEL_NAME, api_key=KEY,
                          max_request_bytes=MAX_BYTES, max_messages=4, max_tools=2,
                          chat_template=SERVER_TEMPLATE)  # fmt: skip

    with live_app(make, config) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(builtin_model()))


def _stats(live: Live) -> Any:
    return live.call(live.engine.statistics)  # type: ignore[union-attr]


def _post(live: Live, path: str, body: Any, headers: dict[str, str] | None = None,
          **kwargs: Any) -> httpx.Response:  # fmt: skip
    content = body if not isinstance(body, dict) else json.dumps(body).encode()
    return httpx.post(live.base_url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or AUTH)},
                      **kwargs)  # fmt: skip


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- the API key ------------------------------------------------------------------------------


def test_a_wrong_key_is_a_401_through_the_openai_client_and_the_engine_sees_nothing(
    guarded: Live,
) -> None:
    before = _stats(guarded)
    client = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    assert KEY not in info.value.response.text and "sk-wrong" not in info.value.response.text
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert _stats(guarded) == before


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"},
     {"authorization": f"Bearer {KEY}x"}, {"authorization": "Bearer"}],
    ids=["missing", "no-scheme", "basic", "longer", "empty"],
)  # fmt: skip
def test_every_v1_route_needs_the_key_before_its_body_is_read(
    guarded: Live, headers: dict[str, str]
) -> None:
    before = _stats(guarded)
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models"), ("GET", "/v1/no-such-route")):  # fmt: skip
        # a body over the size limit: refused for the key, before it is read
        response = httpx.request(method, guarded.base_url + path, headers=headers,
                                 content=b"x" * (2 * MAX_BYTES))  # fmt: skip
        error = _error(response, 401)
        assert response.headers["www-authenticate"] == "Bearer"
        assert error["type"] == "invalid_request_error"
        assert ("didn't provide" in error["message"]) == (not headers)
    assert _stats(guarded) == before


def test_the_right_key_is_served_and_health_and_metrics_stay_open(guarded: Live) -> None:
    client = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    out = client.chat.completions.create(model=MODEL_NAME, max_tokens=3, temperature=0,
                                         messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert out.choices[0].message.role == "assistant"
    for path in ("/health", "/metrics", "/blocks", "/blocks.json"):
        assert httpx.get(guarded.base_url + path).status_code == 200, path


def test_protect_metrics_puts_the_monitoring_routes_behind_the_key() -> None:
    """Checked on an engine not started: a refused request never reaches it, an admitted one
    gets the route's own 503."""
    engine = AsyncEngine(EngineConfig(model=builtin_model()))
    app = create_app(engine, api_key=KEY, protect_metrics=True)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503  # open: the route's own answer
        for path in ("/metrics", "/blocks", "/blocks.json", "/v1/models"):
            assert client.get(path).status_code == 401, path
        assert client.get("/metrics", headers=AUTH).status_code == 503
        assert client.get("/blocks", headers=AUTH).status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        create_app(engine, api_key="")


def test_a_mounted_app_protects_its_own_v1() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    engine = AsyncEngine(EngineConfig(model=builtin_model()))
    host = Starlette(routes=[Mount("/llm", create_app(engine, api_key=KEY))])
    with TestClient(host) as client:
        assert client.get("/llm/v1/models").status_code == 401
        assert client.get("/llm/blocks").status_code == 200
        assert client.get("/llm/v1/models", headers=AUTH).status_code == 503  # not started


# ---- limits -------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413_by_content_length_and_chunked(guarded: Live) -> None:
    before = _stats(guarded)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BYTES}]}
    raw = json.dumps(big).encode()
    error = _error(_post(guarded, "/v1/chat/completions", raw), 413)
    assert str(MAX_BYTES) in error["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
        for i in range(0, len(raw), 1000):
            yield raw[i : i + 1000]

    response = httpx.post(
        guarded.base_url + "/v1/chat/completions",
        content=chunked(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    assert "content-length" not in response.request.headers
    _error(response, 413)
    assert _stats(guarded) == before
    # a body just under the limit is served
    ok = {**CHAT, "messages": [{"role": "user", "content": "y " * 100}]}
    assert _post(guarded, "/v1/chat/completions", ok).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("messages", [{"role": "user", "content": "Hi"}] * 5),
     ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)])],
)  # fmt: skip
def test_too_many_messages_or_tools_is_a_400(guarded: Live, field: str, value: Any) -> None:
    before = _stats(guarded)
    error = _error(_post(guarded, "/v1/chat/completions", {**CHAT, field: value}), 400)
    assert (error["param"], error["code"]) == (field, "array_above_max_length")
    assert "array too long" in error["message"]
    assert _stats(guarded) == before
    at_limit = value[:-1]
    assert _post(guarded, "/v1/chat/completions", {**CHAT, field: at_limit}).status_code == 200


def test_limits_must_be_positive() -> None:
    engine = AsyncEngine(EngineConfig(model=builtin_model()))
    for name in ("max_request_bytes", "max_messages", "max_tools"):
        with pytest.raises(ValueError, match=name):
            create_app(engine, **{name: 0})  # type: ignore[arg-type]


# ---- unknown routes and methods ----------------------------------------------------------------


def test_unknown_paths_and_methods_get_openais_error_body(guarded: Live) -> None:
    error = _error(httpx.get(guarded.base_url + "/v1/engines", headers=AUTH), 404)
    assert error["message"] == "Invalid URL (GET /v1/engines)"
    assert error["type"] == "invalid_request_error"
    _error(httpx.get(guarded.base_url + "/nowhere"), 404)  # outside /v1: no key needed
    response = httpx.get(guarded.base_url + "/v1/chat/completions", headers=AUTH)
    error = _error(response, 405)
    assert response.headers["allow"] == "POST"
    assert "GET" in error["message"] and "POST" in error["message"]
    _error(httpx.post(guarded.base_url + "/health"), 405)


# ---- OpenAI's fields and message shapes ------------------------------------------------------

IGNORED = {
    "user": "u-1", "parallel_tool_calls": False, "reasoning_effort": "low", "verbosity": "low",
    "store": False, "metadata": {"team": "infra"}, "service_tier": "auto",
    "prediction": {"type": "content", "content": "Hello"}, "web_search_options": {},
    "prompt_cache_key": "k", "safety_identifier": "s", "modalities": ["text"], "audio": None,
}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_fields_openai_clients_send_are_accepted_and_ignored(guarded: Live, stream: bool) -> None:
    body = {**CHAT, **IGNORED, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True, "include_obfuscation": False,
                                  "a_future_option": 1}  # fmt: skip
    response = _post(guarded, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    plain = _post(guarded, "/v1/chat/completions", {**CHAT, "stream": stream})
    assert response.text.count("assistant") == plain.text.count("assistant")
    if stream:
        assert '"usage"' in response.text and response.text.rstrip().endswith("[DONE]")


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [({"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
     ({"modalities": ["text", "audio"]}, None, "text only"),
     ({"audio": {"voice": "alloy", "format": "wav"}}, None, "text only")],
)  # fmt: skip
def test_unknown_fields_and_audio_output_are_still_refused(
    guarded: Live, extra: dict[str, Any], param: str | None, message: str
) -> None:
    error = _error(_post(guarded, "/v1/chat/completions", {**CHAT, **extra}), 400)
    assert message in error["message"] and error["param"] == param


def test_content_parts_are_flattened_before_the_servers_template(
    guarded: Live, tokenizer: Any
) -> None:
    parts = [{"type": "text", "text": "The with"}, {"type": "text", "text": "statement"}]
    flat = [{"role": "user", "content": "The with\nstatement"}]
    want = tokenizer.apply_chat_template(flat, chat_template=SERVER_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert want == "user: The with\nstatement\nassistant:"
    body = {**CHAT, "max_tokens": 6, "ignore_eos": True}
    got = _post(
        guarded, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": parts}]}
    )
    same = _post(guarded, "/v1/chat/completions", {**body, "messages": flat})
    assert got.status_code == same.status_code == 200, got.text
    ids = tokenizer.encode(want, add_special_tokens=False)
    assert got.json()["usage"]["prompt_tokens"] == len(ids)
    assert got.json()["choices"][0]["message"] == same.json()["choices"][0]["message"]
    before = _stats(guarded)
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    body = {**CHAT, "messages": [{"role": "user", "content": image}]}
    error = _error(_post(guarded, "/v1/chat/completions", body), 400)
    assert "takes text only" in error["message"]
    assert _stats(guarded) == before


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function",
     "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
]  # fmt: skip


def test_tool_calls_and_tool_messages_reach_the_template(guarded: Live, tokenizer: Any) -> None:
    body = {**CHAT, "messages": TOOL_TURNS, "chat_template": TOOL_TEMPLATE}
    response = _post(guarded, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    text = tokenizer.apply_chat_template(check_messages(TOOL_TURNS), tokenize=False,
                                         chat_template=TOOL_TEMPLATE)  # fmt: skip
    assert "call weather city=Paris" in text and "tool: sunny for call_7" in text
    want = len(tokenizer.encode(text, add_special_tokens=False))
    assert response.json()["usage"]["prompt_tokens"] == want


def test_a_tool_message_without_tool_call_id_is_a_400_and_nothing_is_queued(
    guarded: Live,
) -> None:
    before = _stats(guarded)
    turns = [*TOOL_TURNS[:2], {"role": "tool", "content": "sunny"}]
    for stream in (False, True):
        body = {**CHAT, "messages": turns, "stream": stream}
        error = _error(_post(guarded, "/v1/chat/completions", body), 400)
        assert "tool_call_id" in error["message"]
        assert error["type"] == "invalid_request_error"
    assert _stats(guarded) == before
