"""``tools/proc_stats.py``: the CPU time and RSS of a process read from /proc, and an engine's
CPU time counting its runner's process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from asyncpaged.tools.proc_stats import (
    engine_cpu_s,
    engine_rss_mib,
    process_cpu_s,
    process_rss_mib,
)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

_BURN = (
    "import sys, time\n"
    "end = time.process_time() + 0.4\n"
    "while time.process_time() < end: pass\n"
    "print('burnt', flush=True)\n"
    "sys.stdin.read()\n"  # then wait, alive, until the test closes stdin
)


@dataclass
class _Engine:
    runner_pid: int | None


def test_this_process_reads_as_its_own_clock() -> None:
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    mine, clock = process_cpu_s(os.getpid()), time.process_time()
    assert abs(mine - clock) < 0.05, (mine, clock)  # (clock ticks: 10 ms)
    assert process_rss_mib(os.getpid()) > 10


def test_a_runner_process_is_counted_and_a_gone_one_reads_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        burnt = process_cpu_s(child.pid)
        assert burnt >= 0.35, burnt
        alone = time.process_time()
        assert engine_cpu_s(_Engine(child.pid)) - alone >= 0.35
        assert abs(engine_cpu_s(_Engine(None)) - time.process_time()) < 0.05
        mine, runner = engine_rss_mib(_Engine(child.pid))
        assert mine > 10 and runner > 1
        assert engine_rss_mib(_Engine(None))[1] == 0.0
    finally:
        child.communicate("")
    assert process_cpu_s(child.pid) == 0.0 and process_rss_mib(child.pid) == 0.0  # reaped


def test_peak_rss_counts_the_reaped_runner_process() -> None:
    """``bench throughput``'s peak RSS adds the largest reaped child's (asyncpaged's runner
    process, reaped at the engine's close): measured in a fresh interpreter whose one child
    held ~200 MiB."""
    code = (
        "import resource, subprocess, sys\n"
        "from asyncpaged.tools.bench_engines import peak_rss_mib\n"
        "subprocess.run([sys.executable, '-c', 'b = bytearray(200 << 20); b[::4096] = "
        "bytes(len(b[::4096]))'], check=True)\n"
        "own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
        "print(peak_rss_mib() - own)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert 195 < float(done.stdout) < 400, done.stdout
