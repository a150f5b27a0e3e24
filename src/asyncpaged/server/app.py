"""``create_app(engine)``: the OpenAI-compatible endpoints, health, metrics and the block map as
one Starlette app that a host mounts into its own (the engine stays the host's).

Every request is checked, and its first output awaited, before the response starts: a bad
field, a prompt too long once tokenized, a chat template or JSON schema that fails, or an unknown
model is answered with OpenAI's error body (400, 404 for the model) and never with a 200 or an
SSE header. A client that goes away aborts its requests: a non-streamed request is watched for
``http.disconnect`` while it runs, a streamed one is cancelled by the SSE response.

In front of that: the API key (``BearerAuth``: a 401 before the body is read), the size limits
(``ServerLimits``: 413 for a body, 400 for messages or tools), and OpenAI's body for a path or
method that has no route (404, 405).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from asyncpaged._log import get_logger
from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.errors import (
    EngineDeadError,
    InvalidRequestError,
    NoTokenAllowedError,
    RequestFailedError,
)
from asyncpaged.outputs import RequestOutput
from asyncpaged.sampling_params import SamplingParams
from asyncpaged.server.api_error import ApiError
from asyncpaged.server.auth import BearerAuth
from asyncpaged.server.block_page import PAGE, block_map_json
from asyncpaged.server.limits import MAX_MESSAGES, MAX_REQUEST_BYTES, MAX_TOOLS, ServerLimits
from asyncpaged.server.metrics import ServerMetrics
from asyncpaged.server.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from asyncpaged.server.responses import (
    ChunkWriter,
    chat_response,
    completion_response,
    error_body,
)
from asyncpaged.streams import RequestStream

__all__ = ["create_app"]

log = get_logger(__name__)

T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)


class ClientGone(Exception):
    """The client disconnected before the response started (its requests were aborted)."""


MONITORING_PATHS = ("/metrics", "/blocks", "/blocks.json")


def create_app(
    engine: AsyncEngine,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    protect_metrics: bool = False,
    chat_template: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_messages: int = MAX_MESSAGES,
    max_tools: int = MAX_TOOLS,
) -> Starlette:
    """The server for a running ``engine`` (entered with ``async with`` by the host, which keeps
    it: the app never starts or stops it). ``served_model_name`` is the ``model`` clients send
    (default: ``engine.config.model``). Routes: ``GET /v1/models``, ``POST /v1/completions``,
    ``POST /v1/chat/completions``, ``GET /health``, ``GET /metrics``, ``GET /blocks``,
    ``GET /blocks.json``; any other path or method is a 404 or 405 with OpenAI's error body.

    ``api_key``: every ``/v1`` path needs ``Authorization: Bearer <api_key>`` (401 otherwise,
    before the body is read); ``protect_metrics`` puts ``/metrics``, ``/blocks`` and
    ``/blocks.json`` behind it too (``/health`` always stays open, for probes).
    ``chat_template``: the Jinja template of chat requests that give none (default: the
    tokenizer's). ``max_request_bytes``, ``max_messages`` and ``max_tools``: the most a request
    may carry (:class:`~asyncpaged.server.limits.ServerLimits`)."""
    limits = ServerLimits(max_request_bytes=max_request_bytes, max_messages=max_messages,
                          max_tools=max_tools)  # fmt: skip
    if api_key is not None and not (isinstance(api_key, str) and api_key):
        raise ValueError(f"api_key must be a non-empty str or None, got {api_key!r}.")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError("chat_template must be a str (a Jinja template).")
    model = served_model_name or os.fspath(engine.config.model)
    server = _Server(engine, model, limits, chat_template)
    routes = [
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
        Route("/blocks", server.blocks_page, methods=["GET"]),
        Route("/blocks.json", server.blocks_json, methods=["GET"]),
    ]
    middleware = []
    if api_key is not None:
        protected = MONITORING_PATHS if protect_metrics else ()
        middleware.append(Middleware(BearerAuth, api_key=api_key, also_protected=protected))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _http_error})  # fmt: skip
    app.state.asyncpaged = server
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (a route, not this method) as OpenAI's body."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = (f"Method {request.method} is not allowed for {request.url.path} "
                   f"(allowed: {allowed}).")  # fmt: skip
    else:
        message = exc.detail
    return ApiError(exc.status_code, message, headers=exc.headers).response()


class _Server:
    def __init__(self, engine: AsyncEngine, model: str, limits: ServerLimits,
                 chat_template: str | None) -> None:  # fmt: skip
        self.engine = engine
        self.model = model
        self.limits = limits
        self.chat_template = chat_template
        self.metrics = ServerMetrics(engine)
        self.created = int(time.time())

    # ---- small endpoints ----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        if (why := self._unavailable()) is not None:
            return ApiError(503, why, type_="server_error").response()
        card = {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "asyncpaged", "max_model_len": self.engine.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    def _unavailable(self) -> str | None:
        """Why the engine cannot serve (dead, not started or closed), or None."""
        try:
            self.engine.default_sampling_params()  # raises once the engine is dead or closed
        except EngineDeadError as exc:
            return f"the engine stopped: {exc.__cause__ or exc}"
        except RuntimeError as exc:
            return str(exc)
        return None

    async def health(self, request: Request) -> Response:
        if (why := self._unavailable()) is not None:
            return JSONResponse({"status": "unavailable", "error": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        if (why := self._unavailable()) is not None:
            return ApiError(503, why, type_="server_error").response()
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def blocks_page(self, request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def blocks_json(self, request: Request) -> Response:
        if (why := self._unavailable()) is not None:
            return ApiError(503, why, type_="server_error").response()
        return JSONResponse(block_map_json(self.engine.block_map(), self.engine.statistics()))

    # ---- generation -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self._completions)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, self._chat)

    async def _serve(
        self, request: Request, handler: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if (why := self._unavailable()) is not None:
            return ApiError(503, why, type_="server_error").response()
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except InvalidRequestError as exc:
            return ApiError(400, str(exc)).response()
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except EngineDeadError as exc:
            log.error("request_failed", error=repr(exc.__cause__ or exc))
            return ApiError(503, f"the engine stopped: {exc.__cause__ or exc}",
                            type_="server_error").response()  # fmt: skip
        except RequestFailedError as exc:
            if isinstance(exc.__cause__, NoTokenAllowedError):  # the request's own constraints
                return ApiError(400, f"the request failed: {exc.__cause__}").response()
            return ApiError(500, f"the request failed: {exc.__cause__ or exc}",
                            type_="server_error").response()  # fmt: skip

    async def _body(self, request: Request, model: type[B]) -> B:
        raw = await self.limits.read_body(request)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object.")
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            if first["type"] == "extra_forbidden":
                message = f"Unrecognized request argument supplied: {param}"
            else:
                message = f"{param}: {first['msg']}" if param else str(first["msg"])
            raise ApiError(400, message, param=param) from None
        requested = getattr(body, "model", None)
        if requested is not None and requested != self.model:
            raise ApiError(404, f"The model `{requested}` does not exist.",
                           param="model", code="model_not_found")  # fmt: skip
        return body

    def _params(self, body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        model_sets = "max_tokens" in self.engine.generation_defaults.sampling
        return to_sampling_params(body, stream=body.stream, model_sets_max_tokens=model_sets)

    async def _completions(self, request: Request) -> Response:
        body = await self._body(request, CompletionRequest)
        params = self._params(body)
        prompts = _prompts(body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = _Streams()
        try:
            for i, prompt in enumerate(prompts):
                streams.add(self.engine.generate(prompt, params, request_id=f"{rid}-{i}",
                                                 cache_salt=body.cache_salt))  # fmt: skip
            echo = [self._prompt_text(p) for p in prompts] if body.echo else None
            writer = ChunkWriter(rid, self.model, chat=False, k=params.logprobs or 0)
            return await self._respond(request, body, streams, writer, echo)
        finally:
            await streams.aclose_unless_handed_over()

    async def _chat(self, request: Request) -> Response:
        body = await self._body(request, ChatCompletionRequest)
        self.limits.check_chat(len(body.messages), len(body.tools or ()))
        params = self._params(body)
        template = body.chat_template if body.chat_template is not None else self.chat_template
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = _Streams()
        try:
            streams.add(self.engine.chat(
                body.messages, params, chat_template=template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, tools=body.tools,
                tool_choice=body.tool_choice,
                parallel_tool_calls=body.parallel_tool_calls is not False,
                chat_template_kwargs=body.chat_template_kwargs, request_id=rid,
                cache_salt=body.cache_salt,
            ))  # fmt: skip
            writer = ChunkWriter(rid, self.model, chat=True, k=params.logprobs or 0)
            return await self._respond(request, body, streams, writer, None)
        finally:
            await streams.aclose_unless_handed_over()

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return str(self.engine.tokenizer.decode(prompt))

    async def _respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                       streams: _Streams, writer: ChunkWriter,
                       echo: list[str] | None) -> Response:  # fmt: skip
        if not body.stream:
            finals = await _unless_disconnected(request, [_awaiter(s) for s in streams.items])
            self.metrics.observe(finals)
            if writer.chat:
                return JSONResponse(chat_response(writer.rid, self.model, finals[0], writer.k))
            return JSONResponse(completion_response(writer.rid, self.model, finals, writer.k,
                                                    echo))  # fmt: skip
        firsts = await _unless_disconnected(request, [s.__anext__ for s in streams.items])
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        send, receive = anyio.create_memory_object_stream[str](4)
        pump = _Pump(streams.hand_over(), firsts, writer, echo, include_usage, self.metrics)
        return EventSourceResponse(_events(receive), data_sender_callable=lambda: pump.run(send))


class _Streams:
    """A request's engine streams; closed (so aborted, if unfinished) unless handed over."""

    def __init__(self) -> None:
        self.items: list[RequestStream] = []
        self._handed_over = False

    def add(self, stream: RequestStream) -> None:
        self.items.append(stream)

    def hand_over(self) -> list[RequestStream]:
        self._handed_over = True
        return self.items

    async def aclose_unless_handed_over(self) -> None:
        if not self._handed_over:
            for stream in self.items:
                await stream.aclose()


class _Pump:
    """Runs inside the SSE response: reads every stream, sends chunks, then usage and [DONE].

    The response cancels it when the client disconnects; each stream is closed on the way out,
    which aborts an unfinished request."""

    def __init__(self, streams: list[RequestStream], firsts: list[RequestOutput],
                 writer: ChunkWriter, echo: list[str] | None, include_usage: bool,
                 metrics: ServerMetrics) -> None:  # fmt: skip
        self.streams, self.totals, self.writer = streams, firsts, writer
        self.echo, self.include_usage, self.metrics = echo, include_usage, metrics
        self.error: EngineDeadError | RequestFailedError | None = None

    async def run(self, send: ObjectSendStream[str]) -> None:
        async with send:
            async with anyio.create_task_group() as tg:
                for i in range(len(self.streams)):
                    tg.start_soon(self._one, i, send)
            if self.error is not None:
                exc = self.error
                message = f"{type(exc).__name__}: {exc.__cause__ or exc}"
                await send.send(json.dumps(error_body(message, type_="server_error")))
            else:
                self.metrics.observe(self.totals)
                if self.include_usage:
                    await send.send(json.dumps(self.writer.usage_chunk(self.totals)))
            await send.send("[DONE]")

    async def _one(self, i: int, send: ObjectSendStream[str]) -> None:
        stream, total = self.streams[i], self.totals[i]
        echo = self.echo[i] if self.echo is not None else ""
        try:
            for chunk in self.writer.chunks(i, total, echo):
                await send.send(json.dumps(chunk))
            if not total.finished:
                async for delta in stream:
                    total.add(delta, aggregate=True)
                    for chunk in self.writer.chunks(i, delta):
                        await send.send(json.dumps(chunk))
        except (EngineDeadError, RequestFailedError) as exc:
            self.error = self.error or exc  # the other choices go on; the error ends the stream
        finally:
            await stream.aclose()


async def _events(receive: ObjectReceiveStream[str]) -> AsyncIterator[str]:
    """The SSE body: what the pump sends, until it closes its end."""
    async with receive:
        async for event in receive:
            yield event


def _awaiter(stream: RequestStream) -> Callable[[], Awaitable[RequestOutput]]:
    async def final() -> RequestOutput:
        return await stream

    return final


async def _unless_disconnected(
    request: Request, calls: Sequence[Callable[[], Awaitable[T]]]
) -> list[T]:
    """Await every call concurrently; raise the first error (cancelling the others, which
    aborts their requests), or :class:`ClientGone` if the client disconnects meanwhile."""
    results: list[T | None] = [None] * len(calls)
    errors: list[BaseException] = []
    gone = False
    async with anyio.create_task_group() as tg:

        async def run(i: int) -> None:
            try:
                results[i] = await calls[i]()
            except Exception as exc:
                errors.append(exc)
                tg.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        async with anyio.create_task_group() as calls_tg:
            for i in range(len(calls)):
                calls_tg.start_soon(run, i)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]
    if gone:
        raise ClientGone
    return [r for r in results if r is not None]


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt forms: one text, texts, one token list, token lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
