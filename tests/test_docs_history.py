"""The docs and code comments describe the project as it is, not how it got there: no "session
N", "issue N" or "round N" labels in docs/, src/, tests/, kernels/README.md or README.md.

A figure is labelled by its date and commit (docs/benchmarks.md), a design by what it does and
why (docs/architecture.md). A command-line flag such as ``--rounds 3`` is not a label.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("docs", "src", "tests", "kernels/README.md", "README.md")
SUFFIXES = frozenset({".md", ".py", ".sh", ".toml", ".cpp", ".h"})
# "session 12", "sessions 13-23", "issue 22", "Issue #9", "round 2"; not "--rounds 3"
HISTORY_LABEL = re.compile(r"(?<![-\w])(?:[Ss]essions?|[Ii]ssues?|[Rr]ounds?) #?\d")
THIS_FILE = Path(__file__).resolve()


def history_labels(path: Path) -> list[tuple[int, str]]:
    """Each (line number, line) of ``path`` that carries a history label."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if HISTORY_LABEL.search(line)
    ]


def scanned_files(root: Path = ROOT) -> list[Path]:
    """The text files the rule covers, this test file excluded (it names the patterns)."""
    files: list[Path] = []
    for entry in SCANNED:
        path = root / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(
                p
                for p in sorted(path.rglob("*"))
                if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
            )
    return [p for p in files if p.resolve() != THIS_FILE]


def test_no_history_labels() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in scanned_files()
        for number, line in history_labels(path)
    ]
    assert not hits, "history labels (state the fact; date a figure instead):\n" + "\n".join(hits)


def test_check_catches_a_planted_label(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    planted = tmp_path / "docs" / "notes.md"
    planted.write_text("# Notes\n\nSince session 12 the runner keeps its tables.\n")
    (tmp_path / "docs" / "clean.md").write_text("Run `compare --rounds 3` on a quiet VM.\n")
    found = {p.name: history_labels(p) for p in scanned_files(tmp_path)}
    assert found == {
        "clean.md": [],
        "notes.md": [(3, "Since session 12 the runner keeps its tables.")],
    }


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("measured in session 12", True),
        ("Sessions 13-23 ran on a Zen 5", True),
        ("(issue 22)", True),
        ("Issue #9's goal", True),
        ("round 2: the second token", True),
        ("bench/vllm_cpu.py compare --rounds 5", False),
        ("sessions of the server", False),
        ("issues a request", False),
        ("rounded to 3 digits", False),
    ],
)
def test_pattern(line: str, flagged: bool) -> None:
    assert bool(HISTORY_LABEL.search(line)) is flagged
