"""Matplotlib, imported lazily: plots are an optional extra (``pip install asyncpaged[plots]``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PlottingUnavailableError(RuntimeError):
    """matplotlib is not installed; the benchmark still prints its table and writes JSON."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlottingUnavailableError(
            "PNG plots need matplotlib: pip install 'asyncpaged[plots]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_report(
    out_dir: Path, stem: str, report: object, draw: Callable[[Path], None], indent: int = 2
) -> None:
    """Write ``stem.json`` and, through ``draw``, ``stem.png`` into ``out_dir``; without
    matplotlib the PNG is skipped with a one-line notice on stderr."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=indent) + "\n")
    try:
        draw(out_dir / f"{stem}.png")
    except PlottingUnavailableError as exc:
        print(f"{stem}.png skipped: {exc}", file=sys.stderr)
