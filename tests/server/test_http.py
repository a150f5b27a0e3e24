"""Errors, disconnects, health, metrics and the block map over plain HTTP (httpx)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.sched.block_map import BlockState
from asyncpaged.server import create_app
from tests.server.conftest import MODEL_NAME, Live, builtin_model

# two full blocks of prompt: n > 1 samples share them
LONG = {"model": MODEL_NAME, "prompt": "The with statement is used to wrap the execution of a "
        "block with methods defined by a context manager.", "max_tokens": 440,
        "temperature": 0, "ignore_eos": True}  # fmt: skip


def _post(live: Live, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(live.base_url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"}, **kwargs)  # fmt: skip


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/v1/completions", {**COMPLETION, "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
        ("/v1/completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature", ""),
        ("/v1/completions", {**COMPLETION, "temperature": -1}, 400, None, "temperature"),
        ("/v1/completions", {**COMPLETION, "n": 0}, 400, None, "n must be at least 1"),
        ("/v1/completions", {**COMPLETION, "n": 5000}, 400, None, ""),
        ("/v1/completions", {**COMPLETION, "stop": [""]}, 400, None, "stop"),
        ("/v1/completions", {**COMPLETION, "logprobs": 21}, 400, None, "logprobs"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, None, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"99999": 1}}, 400, None, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt", "empty"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 99999]}, 400, None, "token ids"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 600}, 400, None, "max_model_len"),
        ("/v1/completions", {"prompt": "Hi"} | {"model": "other"}, 404, "model", "does not exist"),
        ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt", ""),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, None, "logprobs=true"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, None, "empty"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, None, "role"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema"}},
            400,
            None,
            "schema",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "structured_outputs": {"json": "{not json"}},
            400,
            None,
            "",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "chat_template": "{{ raise_exception('no') }}"},
            400,
            None,
            "chat template",
        ),
        ("/v1/chat/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, None, "JSON object"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_requests_get_openais_error_body_before_any_stream(
    live: Live, path: str, body: Any, status: int, param: str | None, message: str, stream: bool
) -> None:
    if stream and isinstance(body, dict):
        body = {**body, "stream": True}
    response = _post(live, path, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
    # the engine is unharmed: the next request works
    ok = _post(live, "/v1/completions", COMPLETION)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_constraints_that_allow_no_token_get_a_400_and_harm_nothing(live: Live) -> None:
    """A choice whose every token ``allowed_token_ids`` excludes fails at its first step: 400
    with OpenAI's error body (the request's own fault), and the next request works."""
    body = {**COMPLETION, "structured_outputs": {"choice": ["yes", "no"]},
            "allowed_token_ids": [5, 6]}  # fmt: skip
    response = _post(live, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "every token is ruled out" in error["message"]
    ok = _post(live, "/v1/completions", COMPLETION)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_dropped_stream_aborts_its_request(live: Live) -> None:
    before = live.call(lambda: live.engine.statistics().num_aborted)  # type: ignore[union-attr]
    with httpx.stream("POST", live.base_url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["object"] == "text_completion"
    live.wait_for(lambda: live.engine.statistics().num_aborted > before)  # type: ignore[union-attr]
    live.wait_for(lambda: live.engine.statistics().num_running == 0)  # type: ignore[union-attr]


def test_dropped_plain_request_aborts_it(live: Live) -> None:
    before = live.call(lambda: live.engine.statistics().num_aborted)  # type: ignore[union-attr]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.base_url + "/v1/completions", json={**LONG, "n": 4}, timeout=0.3)
    live.wait_for(lambda: live.engine.statistics().num_aborted > before)  # type: ignore[union-attr]


def test_an_engine_not_running_is_unavailable() -> None:
    """The app may be made before the host enters the engine; until then it answers 503."""
    app = create_app(AsyncEngine(EngineConfig(model=str(builtin_model()))))
    with TestClient(app) as client:
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/blocks.json"),
                             ("POST", "/v1/completions")):  # fmt: skip
            response = client.request(method, path, json=COMPLETION)
            assert response.status_code == 503, (path, response.text)
            assert "not running" in response.text


def test_health(live: Live) -> None:
    response = httpx.get(live.base_url + "/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_metrics_are_prometheus_text_with_engine_counters_and_latencies(live: Live) -> None:
    _post(live, "/v1/completions", {**COMPLETION, "max_tokens": 5})
    response = httpx.get(live.base_url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for family in text_string_to_metric_families(response.text)
               for s in family.samples if not s.labels or "le" not in s.labels}  # fmt: skip
    stats = live.call(live.engine.statistics)  # type: ignore[union-attr]
    assert samples["asyncpaged_kv_device_blocks"] == stats.num_device_blocks
    assert samples["asyncpaged_num_requests_running"] == 0
    assert samples["asyncpaged_num_preemptions_total"] == stats.num_preemptions
    assert samples["asyncpaged_prefix_cache_queries_total"] == stats.prefix_cache_query_tokens
    assert samples["asyncpaged_num_requests_finished_total"] >= 1
    for name in ("kv_device_blocks_used", "kv_device_blocks_cached", "prefix_cache_hit_rate",
                 "num_swap_outs_total", "num_swap_ins_total", "num_requests_waiting"):  # fmt: skip
        assert "asyncpaged_" + name in samples
    assert samples["asyncpaged_time_to_first_token_seconds_count"] >= 1
    assert samples["asyncpaged_time_per_output_token_seconds_count"] >= 1
    assert 0 < samples["asyncpaged_time_to_first_token_seconds_sum"] < 60
    assert samples["asyncpaged_generation_tokens_total"] >= 5


def test_block_page_is_self_contained_html(live: Live) -> None:
    response = httpx.get(live.base_url + "/blocks")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "blocks.json" in page and "<script>" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere


def test_block_map_json_shows_the_running_request(live: Live) -> None:
    seen: dict[str, Any] = {}
    with httpx.stream("POST", live.base_url + "/v1/completions",
                      json={**LONG, "stream": True, "n": 2}, timeout=60) as response:  # fmt: skip
        lines = response.iter_lines()
        chunk = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        seen = httpx.get(live.base_url + "/blocks.json").json()
    # closed early: the request is aborted and its blocks freed
    live.wait_for(lambda: live.engine.block_map().device.count(BlockState.USED) == 0)  # type: ignore[union-attr]
    rid = chunk["id"] + "-0"
    assert [r["id"] for r in seen["requests"]] == [rid]
    assert seen["requests"][0]["status"] == "running"
    used = [b for b in seen["device"]["blocks"] if b[1] == "u"]
    assert len(used) == seen["device"]["counts"]["used"] == seen["requests"][0]["num_device_blocks"]
    assert {seen["holders"][h] for b in used for h in b[4]} == {rid}
    assert seen["requests"][0]["num_seqs"] == 2
    assert any(b[2] == 2 for b in used), "the two samples share the prompt's block"
    assert seen["device"]["num_blocks"] == sum(seen["device"]["counts"].values())
    after = httpx.get(live.base_url + "/blocks.json").json()
    assert after["requests"] == [] and after["device"]["counts"]["used"] == 0
