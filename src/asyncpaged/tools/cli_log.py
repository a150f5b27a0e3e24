"""Logging of the command line, an application: readable engine events on stderr.

Only the programs (``asyncpaged ...`` and the bench worker process) call :func:`configure`; the
library itself configures nothing. It sets up the stdlib logger ``asyncpaged``, where the
library's events go (see ``asyncpaged._log``): records at ``level`` and above are written to
stderr, and a one-time native kernel build prints a progress line at any level.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Final, TextIO

LEVELS: Final = ("debug", "info", "warning", "error")
_BUILD_LOGGER: Final = "asyncpaged.kernels.cpu_build"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the ``sys.stderr`` of the moment (tests and the REPL swap it)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the current sys.stderr


class _BuildProgress(logging.Handler):
    """The kernel build's start and end as plain lines, whatever the log level."""

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "event_fields", {})
        event = getattr(record, "event", None)
        if event == "cpu_kernel_compile_started":
            note = fields.get("note", "building native CPU kernels")
            line = f"asyncpaged: {note} in {Path(str(fields.get('path', '.'))).parent} ..."
        elif event == "cpu_kernel_compiled":
            line = f"asyncpaged: native CPU kernels built in {fields.get('seconds')} s"
        else:
            return
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()


def configure(level: str) -> None:
    """Show the library's events at ``level`` (one of :data:`LEVELS`) and above on stderr.
    Calling it again replaces the previous setup."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}.")
    threshold = logging.getLevelNamesMapping()[level.upper()]
    reset()
    handler = _StderrHandler()
    handler.setLevel(threshold)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger("asyncpaged")
    root.setLevel(threshold)
    root.addHandler(handler)
    if threshold > logging.INFO:  # at info the build's own events show already
        build = logging.getLogger(_BUILD_LOGGER)
        build.setLevel(logging.INFO)
        build.addHandler(_BuildProgress(logging.INFO))


def reset() -> None:
    """Undo :func:`configure` (tests call it between command-line runs)."""
    for name in ("asyncpaged", _BUILD_LOGGER):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, _StderrHandler | _BuildProgress):
                logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
