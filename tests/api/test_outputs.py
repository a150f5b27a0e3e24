"""Output dataclasses: vLLM's fields, finished(), metrics properties, RequestOutput.add."""

from __future__ import annotations

import dataclasses

import pytest

from asyncpaged.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)


def _completion(
    index: int,
    text: str,
    token_ids: list[int],
    *,
    logprobs: list[dict[int, Logprob]] | None = None,
    cumulative_logprob: float | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
) -> CompletionOutput:
    return CompletionOutput(
        index,
        text,
        token_ids,
        cumulative_logprob,
        logprobs,
        finish_reason,  # type: ignore[arg-type]
        stop_reason,
    )


def test_field_order_matches_vllm() -> None:
    """vLLM's positional fields first; the parsed chat reply's after them (vLLM has none)."""
    assert [f.name for f in dataclasses.fields(CompletionOutput)][:7] == [
        "index",
        "text",
        "token_ids",
        "cumulative_logprob",
        "logprobs",
        "finish_reason",
        "stop_reason",
    ]
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]
    assert [f.name for f in dataclasses.fields(RequestOutput)][:6] == [
        "request_id",
        "prompt",
        "prompt_token_ids",
        "outputs",
        "finished",
        "metrics",
    ]


def test_completion_finished() -> None:
    completion = CompletionOutput(0, "hi", [1, 2], None, None)
    assert completion.finish_reason is None
    assert completion.stop_reason is None
    assert not completion.finished()
    completion.finish_reason = "length"
    assert completion.finished()
    assert _completion(0, "", [], finish_reason="stop", stop_reason="\n").finished()


def test_logprob_defaults() -> None:
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)


def test_slots() -> None:
    with pytest.raises(AttributeError):
        Logprob(-1.0).extra = 1  # type: ignore[attr-defined]


def test_metrics_durations() -> None:
    metrics = RequestMetrics(arrival_time=10.0)
    assert metrics.time_in_queue_s is None
    assert metrics.time_to_first_token_s is None
    assert metrics.e2e_latency_s is None
    assert metrics.num_preemptions == 0
    metrics.first_scheduled_time = 10.5
    metrics.first_token_time = 11.25
    metrics.finished_time = 13.0
    assert metrics.time_in_queue_s == 0.5
    assert metrics.time_to_first_token_s == 1.25
    assert metrics.e2e_latency_s == 3.0


def test_add_aggregates_deltas() -> None:
    lp1 = {5: Logprob(-0.1, 1, "a")}
    lp2 = {6: Logprob(-0.2, 1, "b")}
    lp3 = {7: Logprob(-0.3, 2, "c")}
    first = RequestOutput(
        "r",
        "p",
        [1],
        [_completion(0, "a", [5], logprobs=[lp1], cumulative_logprob=-0.1)],
        False,
    )
    second = RequestOutput(
        "r",
        "p",
        [1],
        [
            _completion(0, "bc", [6, 7], logprobs=[lp2, lp3], cumulative_logprob=-0.6),
            _completion(1, "z", [9]),
        ],
        False,
        num_cached_tokens=1,
    )
    third = RequestOutput(
        "r",
        "p",
        [1],
        [_completion(0, "", [8], cumulative_logprob=-0.7, finish_reason="stop", stop_reason=8)],
        True,
        metrics=RequestMetrics(arrival_time=1.0),
    )
    delta_tokens = second.outputs[0].token_ids
    first.add(second, aggregate=True)
    first.add(third, aggregate=True)
    assert delta_tokens == [6, 7], "merging must not change the delta's own lists"
    assert first.finished
    assert first.num_cached_tokens == 1
    assert first.metrics == RequestMetrics(arrival_time=1.0)
    assert [c.index for c in first.outputs] == [0, 1]
    merged = first.outputs[0]
    assert merged.text == "abc"
    assert merged.token_ids == [5, 6, 7, 8]
    assert merged.logprobs == [lp1, lp2, lp3]
    assert merged.cumulative_logprob == -0.7
    assert (merged.finish_reason, merged.stop_reason) == ("stop", 8)
    assert first.outputs[1].text == "z"


def test_add_replaces_cumulative() -> None:
    first = RequestOutput("r", None, [1], [_completion(0, "ab", [2, 3])], False)
    newer = _completion(0, "abc", [2, 3, 4], finish_reason="length")
    first.add(RequestOutput("r", None, [1], [newer], True), aggregate=False)
    assert first.outputs == [newer]
    assert first.finished


def test_add_keeps_finished() -> None:
    first = RequestOutput("r", None, None, [], True)
    first.add(RequestOutput("r", None, None, [], False), aggregate=True)
    assert first.finished


def test_add_refuses_another_request() -> None:
    first = RequestOutput("a", None, None, [], False)
    with pytest.raises(AssertionError, match="cannot merge"):
        first.add(RequestOutput("b", None, None, [], False), aggregate=True)
