"""CPU time and resident memory of an engine's processes, for the benchmarks: this process and,
with ``executor_backend="process"``, the runner's own (``AsyncEngine.runner_pid``), where the
forward's CPU time and the KV cache are. Read from ``/proc`` (Linux); elsewhere the runner's
share reads as 0."""

from __future__ import annotations

import os
import time
from typing import Protocol


class HasRunnerPid(Protocol):
    @property
    def runner_pid(self) -> int | None: ...


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command name (which may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0.0 if unreadable)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (0.0 if unreadable)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def engine_cpu_s(engine: HasRunnerPid) -> float:
    """This process's CPU seconds plus the runner process's, if it has one."""
    pid = engine.runner_pid
    return time.process_time() + (process_cpu_s(pid) if pid is not None else 0.0)


def engine_rss_mib(engine: HasRunnerPid) -> tuple[float, float]:
    """(this process's, the runner process's) resident MiB; the second is 0.0 without one."""
    pid = engine.runner_pid
    return process_rss_mib(os.getpid()), (process_rss_mib(pid) if pid is not None else 0.0)


__all__ = ["engine_cpu_s", "engine_rss_mib", "process_cpu_s", "process_rss_mib"]
