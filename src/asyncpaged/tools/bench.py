"""``asyncpaged bench MODE``: throughput, latency, memory, multiturn, structured, overhead, soak,
speculative, quantized, kv-accuracy.

Each mode is its own module (``bench_throughput``, ``bench_latency``, ``bench_memory``) with an
``add_parser`` and a ``run``; the reference workload they share is in ``bench_workload``.
"""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    from asyncpaged.tools import (
        bench_kv_accuracy,
        bench_latency,
        bench_memory,
        bench_multiturn,
        bench_overhead,
        bench_quantized,
        bench_soak,
        bench_speculative,
        bench_structured,
        bench_throughput,
    )

    parser = sub.add_parser("bench", help="throughput, latency and memory benchmarks")
    modes = parser.add_subparsers(dest="mode", required=True)
    bench_throughput.add_parser(modes)
    bench_latency.add_parser(modes)
    bench_memory.add_parser(modes)
    bench_multiturn.add_parser(modes)
    bench_structured.add_parser(modes)
    bench_soak.add_parser(modes)
    bench_overhead.add_parser(modes)
    bench_speculative.add_parser(modes)
    bench_quantized.add_parser(modes)
    bench_kv_accuracy.add_parser(modes)
