"""Every program under examples/ runs to completion (small settings, the built-in model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Arguments that keep each run short; every example must be listed here or in TESTED_ELSEWHERE.
ARGS: dict[str, tuple[str, ...]] = {
    "asyncio_streaming.py": ("--max-tokens", "4"),
    "block_pool_tour.py": (),
    "generate.py": (),
    "trio_host.py": ("--max-tokens", "4"),
    "tool_loop.py": (),
}
TESTED_ELSEWHERE = {
    "fastapi_mount.py": "a server that runs until stopped: tests/server/test_mount_and_cli.py",
}
# A line each run must print (proof it did its work, not only that it exited 0).
EXPECT = {
    "asyncio_streaming.py": "3 requests finished",
    "block_pool_tour.py": "c: cached tokens",
    "generate.py": "EngineStatistics(",
    "trio_host.py": "aborted 1, free blocks 64/64",
    "tool_loop.py": "tool loop done",
}


def test_every_example_is_run_somewhere() -> None:
    found = {p.name for p in EXAMPLES.glob("*.py")}
    assert found == set(ARGS) | set(TESTED_ELSEWHERE)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_example_runs(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *ARGS[name]],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert EXPECT[name] in done.stdout, done.stdout[-2000:]
