"""A live server for the tests: uvicorn on 127.0.0.1 (a port the OS picks), the engine and the
app in a background thread's event loop, driven from the test's thread by real HTTP clients."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import openai
import pytest
import torch
import uvicorn
from starlette.types import ASGIApp

from asyncpaged import AsyncEngine, EngineConfig
from asyncpaged.server import create_app
from asyncpaged.tools.demo import default_model
from tests.engine.conftest import assert_no_leaks

T = TypeVar("T")
MODEL_NAME = "test-model"


@dataclass
class Live:
    """A running server: its base URL, and its engine (read it through :meth:`call`)."""

    base_url: str
    engine: AsyncEngine | None
    token: anyio.lowlevel.EventLoopToken

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the server's event loop thread (engine state lives there)."""
        return anyio.from_thread.run_sync(fn, token=self.token)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0,
                             timeout=60, **kwargs)  # fmt: skip

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.call(predicate):
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.02)


@contextmanager
def live_app(
    make_app: Callable[[AsyncEngine | None], ASGIApp],
    engine_config: EngineConfig | None,
    *,
    lifespan: str = "off",
) -> Iterator[Live]:
    """Serve ``make_app(engine)`` (the engine entered first, when a config is given) until the
    block ends; then stop uvicorn, wait until the engine is idle and check that no block leaked.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead (and on 2 cores, 50x)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with _maybe_engine(engine_config) as engine:
            config = uvicorn.Config(make_app(engine), lifespan=lifespan, log_level="warning")
            server = uvicorn.Server(config)
            box.update(server=server, engine=engine, token=anyio.lowlevel.current_token())
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve, [sock])
                while not server.started and not tg.cancel_scope.cancel_called:
                    await anyio.sleep(0.01)
                ready.set()
            if engine is not None:
                with anyio.fail_after(30):
                    await engine.wait_idle()
                assert_no_leaks(engine)

    def run() -> None:
        try:
            anyio.run(main)
        except BaseException as exc:
            box["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="live-server", daemon=True)
    thread.start()
    assert ready.wait(120), "the server did not start"
    if "error" in box:
        raise box["error"]
    try:
        yield Live(f"http://127.0.0.1:{port}", box["engine"], box["token"])
    finally:
        box["server"].should_exit = True
        thread.join(60)
        torch.set_num_threads(threads)
        assert not thread.is_alive(), "the server thread did not stop"
        if "error" in box:
            raise box["error"]


@asynccontextmanager
async def _maybe_engine(config: EngineConfig | None) -> Any:
    if config is None:
        yield None
        return
    async with AsyncEngine(config) as engine:
        yield engine


def builtin_model() -> Path:
    return Path(default_model())


@pytest.fixture(scope="package")
def live() -> Iterator[Live]:
    """One server on the built-in model for the package (engine start costs seconds)."""
    config = EngineConfig(model=str(builtin_model()), dtype="float32")

    def make(engine: AsyncEngine | None) -> ASGIApp:
        assert engine is not None
        return create_app(engine, served_model_name=MODEL_NAME)

    with live_app(make, config) as server:
        yield server
