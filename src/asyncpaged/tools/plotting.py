"""Matplotlib, imported lazily: plots are an optional extra (``pip install asyncpaged[plots]``)."""

from __future__ import annotations

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
