"""An OpenAI-compatible server that a host mounts next to its own routes (``pip install
'asyncpaged[serve]'``): ``app.mount("/llm", create_app(engine))``. See docs/server.md."""

from asyncpaged.server.app import create_app

__all__ = ["create_app"]
