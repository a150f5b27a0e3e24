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
# a word ("session(s)", "issue(s)", "round(s)") and a number ("12", "#9"); not "--rounds 3"
HISTORY_LABEL = re.compile(r"(?<![-\w])(?:[Ss]essions?|[Ii]ssues?|[Rr]ounds?) #?\d")


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
    return files


def test_no_history_labels() -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in scanned_files()
        for number, line in history_labels(path)
    ]
    assert not hits, "history labels (state the fact; date a figure instead):\n" + "\n".join(hits)


def _label(word: str, number: str) -> str:
    """A history label, built so that this file carries none itself (the scan covers it)."""
    return f"{word} {number}"


def test_check_catches_a_planted_label(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    planted = tmp_path / "docs" / "notes.md"
    line = f"Since {_label('session', '12')} the runner keeps its tables."
    planted.write_text(f"# Notes\n\n{line}\n")
    (tmp_path / "docs" / "clean.md").write_text("Run `compare --rounds 3` on a quiet VM.\n")
    found = {p.name: history_labels(p) for p in scanned_files(tmp_path)}
    assert found == {
        "clean.md": [],
        "notes.md": [(3, line)],
    }


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        (f"measured in {_label('session', '12')}", True),
        (f"{_label('Sessions', '13-23')} ran on a Zen 5", True),
        (f"({_label('issue', '22')})", True),
        (f"{_label('Issue', '#9')}'s goal", True),
        (f"{_label('round', '2')}: the second token", True),
        ("bench/vllm_cpu.py compare --rounds 5", False),
        ("sessions of the server", False),
        ("issues a request", False),
        ("rounded to 3 digits", False),
    ],
)
def test_pattern(line: str, flagged: bool) -> None:
    assert bool(HISTORY_LABEL.search(line)) is flagged
