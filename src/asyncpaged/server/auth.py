"""``BearerAuth``: the API key check, an ASGI middleware in front of the routes.

It reads only the request's headers, so an unauthenticated request is answered (401, OpenAI's
body) before its body is read and never reaches a route, let alone the engine. Keys are
compared with ``hmac.compare_digest`` (constant time), and the key is never echoed back.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from asyncpaged.server.api_error import ApiError

__all__ = ["BearerAuth"]

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


class BearerAuth:
    """Requires ``Authorization: Bearer <api_key>`` on every path under ``/v1`` and on the
    ``also_protected`` paths (paths as the app sees them, below wherever it is mounted); other
    paths pass unchecked."""

    def __init__(self, app: ASGIApp, *, api_key: str, also_protected: Collection[str] = ()) -> None:
        assert api_key, "create_app checks the key: a non-empty str"
        self.app = app
        self._key = api_key.encode()
        self._also_protected = frozenset(also_protected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._is_protected(_route_path(scope)):
            error = self._refusal(dict(scope["headers"]).get(b"authorization"))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _is_protected(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path in self._also_protected

    def _refusal(self, header: bytes | None) -> ApiError | None:
        """None when ``header`` carries the key, else the 401 to answer."""
        challenge = {"WWW-Authenticate": "Bearer"}
        if not header:
            return ApiError(401, _MISSING, headers=challenge)
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            return ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                            headers=challenge)  # fmt: skip
        return None


def _route_path(scope: Scope) -> str:
    """The path below the app's mount point (Starlette keeps the full path in ``path`` and the
    mount point in ``root_path``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path
