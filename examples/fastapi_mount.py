"""Mount the OpenAI-compatible server under /llm next to a host app's own routes.

.venv/bin/python examples/fastapi_mount.py [--model PATH] [--port 8000]

The host owns the engine: its lifespan enters ``async with engine`` and leaves it at shutdown;
``create_app(engine)`` only serves it. The same two lines work in FastAPI
(``app = FastAPI(lifespan=lifespan); app.mount("/llm", create_app(engine))``); this example uses
Starlette, which FastAPI is built on, so that it runs with the ``serve`` extra alone. Try::

    curl localhost:8000/                      # the host's own route
    curl localhost:8000/llm/v1/models
    curl localhost:8000/llm/v1/completions -H 'content-type: application/json' \\
        -d '{"prompt": "The return statement", "max_tokens": 16}'
    open http://localhost:8000/llm/blocks      # the live block map
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.server import create_app


def build_app(model: str) -> Starlette:
    """The host's app: its own routes, and the engine's server mounted under /llm."""
    engine = AsyncEngine(EngineConfig(model=model))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:  # started with the host, stopped with it
            yield

    async def home(request: Request) -> JSONResponse:
        stats = engine.statistics()
        return JSONResponse({"app": "host", "llm": "/llm/v1", "running": stats.num_running,
                             "finished": stats.num_finished})  # fmt: skip

    routes = [Route("/", home), Mount("/llm", app=create_app(engine, served_model_name="demo"))]
    return Starlette(routes=routes, lifespan=lifespan)


if __name__ == "__main__":
    import uvicorn

    from asyncpaged.tools.demo import default_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="an HF checkpoint directory (default: the built-in one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(build_app(args.model or default_model()), host=args.host, port=args.port)
