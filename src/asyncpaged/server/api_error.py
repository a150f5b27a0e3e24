"""``ApiError``: an error the server answers with OpenAI's body before any response starts."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

from asyncpaged.server.responses import error_body

__all__ = ["ApiError"]


class ApiError(Exception):
    """An error answered with OpenAI's body (``{"error": {"message", "type", "param",
    "code"}}``) and ``status``, before any response has started."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code,
        )  # fmt: skip
        self.headers = headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, type_=self.type, param=self.param, code=self.code)
        return JSONResponse(
            body,
            status_code=self.status,
            headers=None if self.headers is None else dict(self.headers),
        )
