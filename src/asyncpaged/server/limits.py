"""``ServerLimits``: the most a request may carry (body bytes, chat messages, tools), checked
before the engine sees the request."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from asyncpaged.server.api_error import ApiError

__all__ = ["MAX_MESSAGES", "MAX_REQUEST_BYTES", "MAX_TOOLS", "ServerLimits"]

MAX_REQUEST_BYTES = 32 << 20  # 32 MiB: far above any prompt a context window holds
MAX_MESSAGES = 2048
MAX_TOOLS = 128  # OpenAI's own limit on ``tools``


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """A body over ``max_request_bytes`` is a 413 (its ``Content-Length`` is checked before
    anything is read; a body without one, chunked, is counted as it arrives and refused once
    over); a chat request with more than ``max_messages`` messages or ``max_tools`` tools is a
    400 (``code: "array_above_max_length"``, OpenAI's)."""

    max_request_bytes: int = MAX_REQUEST_BYTES
    max_messages: int = MAX_MESSAGES
    max_tools: int = MAX_TOOLS

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_messages", "max_tools"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be at least 1, got {value!r}.")

    async def read_body(self, request: Request) -> bytes:
        """The request's body, or :class:`ApiError` 413 once it is over the limit (unread
        beyond that point). Cancelled midway, it has read part of the body, which is lost."""
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise ApiError(400, f"Content-Length is not a number: {declared!r}.") from None
            if size > self.max_request_bytes:
                raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"The request body is over {self.max_request_bytes} bytes "
                        "(the server's max_request_bytes).")  # fmt: skip

    def check_chat(self, num_messages: int, num_tools: int) -> None:
        """:class:`ApiError` 400 for more messages or tools than allowed."""
        for name, count, limit in (("messages", num_messages, self.max_messages),
                                   ("tools", num_tools, self.max_tools)):  # fmt: skip
            if count > limit:
                raise ApiError(
                    400, f"Invalid '{name}': array too long. Expected an array with maximum "
                    f"length {limit}, but got an array with length {count} instead.",
                    param=name, code="array_above_max_length",
                )  # fmt: skip
