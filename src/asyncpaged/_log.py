"""The library's loggers: structlog events delivered through stdlib ``logging``.

``get_logger(__name__)`` returns a logger with structlog's call style
(``log.info("request_added", request_id=...)``, ``log.bind(actor=...)``) that configures nothing
global. Each event goes to the stdlib logger of that name (``asyncpaged`` or a child of it) as
one record whose message is ``event key=value ...`` (the record also carries ``event`` and
``event_fields`` for handlers that want the structure); the host's logging configuration decides
what shows. ``logging.basicConfig(level=logging.WARNING)`` hides every debug and info event.

No handler is installed, not even a ``NullHandler``: a host that configured nothing gets what
stdlib gives any unconfigured logger, so warnings and errors (an engine failure, a
``generation_config.json`` value ignored, a kernel that could not be built) reach stderr through
``logging.lastResort`` and debug and info events are dropped. A host that wants the library
silent sets ``logging.getLogger("asyncpaged").setLevel(logging.CRITICAL)`` or adds its own
handler.

A host that configures structlog itself (``structlog.configure(...)``, and
``structlog.testing.capture_logs()``) gets the events through that configuration instead, as
structlog's own ``get_logger`` would: then structlog's settings decide.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

__all__ = ["LibraryLogger", "get_logger"]


def _render(
    logger: logging.Logger, method_name: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor: the stdlib call's arguments, ``event key=value ...`` as message."""
    event = str(event_dict.pop("event", ""))
    exc_info = event_dict.pop("exc_info", None)
    stack_info = bool(event_dict.pop("stack_info", False))
    fields = " ".join(f"{key}={value!r}" for key, value in event_dict.items())
    message = f"{event} {fields}" if fields else event
    extra = {"event": event, "event_fields": dict(event_dict)}
    return (message,), {"exc_info": exc_info, "stack_info": stack_info, "extra": extra}


_PROCESSORS: list[Any] = [structlog.stdlib.filter_by_level, _render]


class LibraryLogger:
    """structlog's bound-logger calls, routed per call: through the host's structlog
    configuration when there is one, else to the stdlib logger ``name`` (see the module)."""

    __slots__ = ("_context", "_name", "_stdlib")

    def __init__(self, name: str, context: Mapping[str, Any] | None = None) -> None:
        self._name = name
        self._context = dict(context or {})
        self._stdlib: Any = structlog.wrap_logger(
            logging.getLogger(name),
            processors=_PROCESSORS,
            wrapper_class=structlog.stdlib.BoundLogger,
            context_class=dict,
            cache_logger_on_first_use=True,
            **self._context,
        )

    def _target(self) -> Any:
        if structlog.is_configured():  # the host set structlog up: its choice
            return structlog.get_logger(self._name, **self._context)
        return self._stdlib

    def bind(self, **fields: Any) -> LibraryLogger:
        """A logger whose events also carry ``fields``."""
        return LibraryLogger(self._name, {**self._context, **fields})

    def debug(self, event: str, **fields: Any) -> None:
        self._target().debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._target().info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._target().warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._target().error(event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error with the exception being handled (its traceback in the record)."""
        self._target().exception(event, **fields)


def get_logger(name: str = "asyncpaged") -> LibraryLogger:
    """The logger for module ``name`` (``__name__``): names outside the ``asyncpaged`` tree (the
    kernels imported as a top-level package) are placed under it."""
    if name != "asyncpaged" and not name.startswith("asyncpaged."):
        name = f"asyncpaged.{name}"
    return LibraryLogger(name)
