"""Every Python snippet in README.md and docs/ runs as written, each in a fresh interpreter.

A snippet that needs what this machine does not have says so on the line before its fence
(``<!-- snippet not run: why -->``); those are listed in ``NOT_RUN``, so a new one is a decision.
The OpenAI client snippet of docs/server.md talks to ``asyncpaged serve``: the test starts one
and points the snippet at its port.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
NOT_RUN_MARK = re.compile(r"<!-- snippet not run: (.+?) -->\s*$")
NOT_RUN = {("docs/distributed.md", "needs torchrun across CUDA machines")}
NEEDS_SERVER = ("docs/server.md", 'base_url="http://127.0.0.1:8000/v1"')


@dataclass(frozen=True)
class Snippet:
    path: str
    line: int
    code: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def snippets(root: Path = ROOT) -> list[Snippet]:
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = NOT_RUN_MARK.search(before)
            found.append(Snippet(doc.relative_to(root).as_posix(), text[: match.start()].count(
                "\n") + 1, match.group(1), mark.group(1) if mark else None))  # fmt: skip
    return found


def _run(code: str, tmp_path: Path, timeout: float = 240) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


RUNNABLE = [s for s in snippets() if s.not_run is None]


def test_the_snippets_not_run_are_the_known_ones() -> None:
    assert {(s.path, s.not_run) for s in snippets() if s.not_run} == NOT_RUN
    assert len(RUNNABLE) >= 8


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.path == NEEDS_SERVER[0] and NEEDS_SERVER[1] in snippet.code:
        with _serving() as port:
            _run(snippet.code.replace(":8000/", f":{port}/"), tmp_path)
        return
    _run(snippet.code, tmp_path)


class _serving:
    """``asyncpaged serve`` on the built-in model and a free port, for the client snippet."""

    def __enter__(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncpaged", "serve", "--port", str(self.port),
             "--executor-backend", "thread"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self.port
            except OSError:
                time.sleep(0.3)
        raise AssertionError("asyncpaged serve did not listen within 120 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            assert self.proc.stderr is not None
            self.proc.stderr.close()


def test_a_broken_snippet_fails(tmp_path: Path) -> None:
    """The runner reports a snippet that raises (here: the README's first snippet as it once
    was, without its imports)."""
    with pytest.raises(AssertionError, match="NameError"):
        _run("async def main():\n    EngineConfig(model='x')\n\nimport anyio\nanyio.run(main)\n",
             tmp_path)  # fmt: skip
