"""``GET /metrics``: the engine's counters and the server's request latencies, in Prometheus'
text format, from a registry of the app's own (never ``prometheus_client``'s global one).

Gauges and counters are read from ``engine.statistics()`` at scrape time; the histograms are
observed by the server from each finished request's :class:`RequestMetrics` (requests served
through this app only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.outputs import RequestOutput

__all__ = ["PREFIX", "ServerMetrics"]

PREFIX = "asyncpaged_"
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# (metric name without prefix, EngineStatistics field, help)
_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running queue."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be admitted."),
    ("num_requests_swapped", "num_swapped", "Requests whose KV blocks are on the host."),
    ("kv_device_blocks", "num_device_blocks", "Device KV blocks in the pool."),
    ("kv_device_blocks_cached", "num_cached_device_blocks",
     "Device blocks held by no request but kept by the prefix cache (evictable)."),
    ("kv_device_blocks_shared", "num_shared_device_blocks",
     "Device blocks with more than one holder."),
    ("kv_host_blocks", "num_host_blocks", "Host (swap) KV blocks in the pool."),
)  # fmt: skip
_DERIVED = (
    ("kv_device_blocks_used", "Device blocks held by requests or pins."),
    ("kv_cache_usage_ratio", "Share of device blocks in use (0..1)."),
    ("kv_host_blocks_used", "Host blocks held by swapped requests."),
    ("prefix_cache_hit_rate", "Prompt tokens served by the prefix cache, 0..1."),
)
_COUNTERS = (
    ("num_preemptions", "num_preemptions", "Requests preempted (swap or recompute)."),
    ("num_swap_outs", "num_swap_outs", "Request groups swapped out to the host."),
    ("num_swap_ins", "num_swap_ins", "Request groups swapped back in."),
    ("num_recomputes", "num_recomputes", "Preemptions by recompute."),
    ("num_cow_copies", "num_cow_copies", "Copy-on-write block copies."),
    ("prefix_cache_queries", "prefix_cache_query_tokens", "Prompt tokens looked up."),
    ("prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens served from the cache."),
    ("num_requests_finished", "num_finished", "Requests finished (any reason)."),
    ("num_requests_aborted", "num_aborted", "Requests aborted."),
    ("num_steps", "num_steps", "Engine steps."),
    ("step_time_seconds", "step_time_s", "Seconds the executor spent on steps."),
)  # fmt: skip


class _EngineCollector(Collector):
    """Reads ``engine.statistics()`` at every scrape (a cheap, synchronous snapshot)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def describe(self) -> Iterator[Metric]:
        """The metric names without values: the registry asks at registration, which may come
        before the engine has started (``create_app`` on an engine not yet entered)."""
        for name, _, doc in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc)
        for name, doc in _DERIVED:
            yield GaugeMetricFamily(PREFIX + name, doc)
        for name, _, doc in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc)

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        for name, attr, doc in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(stats, attr))
        used = stats.num_device_blocks - stats.num_free_device_blocks
        queries = stats.prefix_cache_query_tokens
        values = (
            used,
            used / stats.num_device_blocks if stats.num_device_blocks else 0.0,
            stats.num_host_blocks - stats.num_free_host_blocks,
            stats.prefix_cache_hit_tokens / queries if queries else 0.0,
        )
        for (name, doc), value in zip(_DERIVED, values, strict=True):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        for name, attr, doc in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(stats, attr))


class ServerMetrics:
    """The app's registry: engine statistics plus per-request latency histograms."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        reg = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "From arrival to the first output token.",
                              buckets=_TTFT_BUCKETS, registry=reg)  # fmt: skip
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time between output tokens of a request, after the first.",
                              buckets=_TPOT_BUCKETS, registry=reg)  # fmt: skip
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "From arrival to the end of a request.",
                             buckets=_E2E_BUCKETS, registry=reg)  # fmt: skip
        self.queue = Histogram(PREFIX + "request_queue_time_seconds",
                               "From arrival to first being scheduled.",
                               buckets=_TTFT_BUCKETS, registry=reg)  # fmt: skip
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of served requests.",
                                     registry=reg)  # fmt: skip
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Tokens generated for served requests.",
                                         registry=reg)  # fmt: skip
        self.requests = Counter(PREFIX + "request_success",
                                "Requests served, by the finish reason of their first choice.",
                                ["finished_reason"], registry=reg)  # fmt: skip

    def observe(self, outputs: Sequence[RequestOutput]) -> None:
        """Record finished requests (cumulative outputs: their token counts are complete)."""
        for out in outputs:
            if not out.finished:
                continue
            m = out.metrics
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.requests.labels(finished_reason=str(reason)).inc()
            self.prompt_tokens.inc(len(out.prompt_token_ids or ()))
            num_tokens = [len(c.token_ids) for c in out.outputs]
            self.generation_tokens.inc(sum(num_tokens))
            if m is None:
                continue
            if (ttft := m.time_to_first_token_s) is not None:
                self.ttft.observe(ttft)
            if (e2e := m.e2e_latency_s) is not None:
                self.e2e.observe(e2e)
            if (queue := m.time_in_queue_s) is not None:
                self.queue.observe(queue)
            longest = max(num_tokens, default=0)
            if m.first_token_time is not None and m.last_token_time is not None and longest > 1:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
