"""The runner process's log events, delivered through the engine's process.

The library's events go to the stdlib logger ``asyncpaged`` and the host's logging configuration
decides what shows (``_log.py``). The runner's process (``executor_backend="process"``) has no
host configuration, so its events (the KV tiers' disk warnings, the CPU levers' fallbacks,
CUDA graphs captured, a draft model loaded) would go to its stderr or nowhere. Instead it
captures them (:func:`capture_library_logs`: one handler on its own ``asyncpaged`` logger, at
the level the engine's process had for it at start) and sends them down its pipe as a
:class:`LogBatch` before its next reply; the engine's process hands each record to the logger
of the same name there (:func:`emit`), so the host's handlers, levels and filters apply. A
record keeps its time, its process id and its structure (``event``, ``event_fields``).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any

LIBRARY_LOGGER = "asyncpaged"


@dataclass(frozen=True, slots=True)
class LogBatch:
    """Records captured in the runner's process, as ``logging.makeLogRecord`` dicts."""

    records: tuple[dict[str, Any], ...]


class LogCapture(logging.Handler):
    """Keeps each record as a picklable dict until :meth:`take`; ``process_name`` names the
    process in them (the runner's, or a tensor-parallel rank's); ``before``: the library
    logger's propagate and level before the capture (:func:`release_library_logs`)."""

    def __init__(self, process_name: str, before: tuple[bool, int]) -> None:
        super().__init__()
        self._records: list[dict[str, Any]] = []
        self._process_name = process_name
        self.before = before

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = getattr(record, "event_fields", None)
            if fields is not None:
                try:
                    pickle.dumps(fields)
                except Exception:  # a value that does not cross: the message still has it
                    fields = None
            self._records.append({
                "name": record.name, "levelno": record.levelno, "levelname": record.levelname,
                "msg": record.getMessage(), "created": record.created, "msecs": record.msecs,
                "process": record.process, "processName": self._process_name,
                "event": getattr(record, "event", None), "event_fields": fields,
                "exc_text": (logging.Formatter().formatException(record.exc_info)
                             if record.exc_info else None),
            })  # fmt: skip
        except Exception:
            self.handleError(record)

    def take(self) -> LogBatch | None:
        """What was captured since the last call (None if nothing)."""
        if not self._records:
            return None
        batch, self._records = LogBatch(tuple(self._records)), []
        return batch


def capture_library_logs(level: int, process_name: str = "asyncpaged-runner") -> LogCapture:
    """In the runner's process (or a tensor-parallel rank's): keep the library's events at
    ``level`` and above for the engine's process (nothing of them reaches this process's
    stderr) until :func:`release_library_logs`."""
    logger = logging.getLogger(LIBRARY_LOGGER)
    handler = LogCapture(process_name, (logger.propagate, logger.level))
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(level)
    return handler


def release_library_logs(handler: LogCapture) -> None:
    """Stop capturing: the library's logger as it was before :func:`capture_library_logs`
    (a torchrun rank's own logging configuration applies again)."""
    logger = logging.getLogger(LIBRARY_LOGGER)
    logger.removeHandler(handler)
    logger.propagate, level = handler.before
    logger.setLevel(level)


def library_level() -> int:
    """In the engine's process: the level the runner's process captures at."""
    return logging.getLogger(LIBRARY_LOGGER).getEffectiveLevel()


def emit(batch: LogBatch) -> None:
    """In the engine's process: each record to the logger of its name, as if logged here."""
    for fields in batch.records:
        logger = logging.getLogger(fields["name"])
        if logger.isEnabledFor(fields["levelno"]):
            logger.handle(logging.makeLogRecord(fields))


__all__ = [
    "LogBatch",
    "LogCapture",
    "capture_library_logs",
    "emit",
    "library_level",
    "release_library_logs",
]
