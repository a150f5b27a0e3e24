"""``LLM``: a synchronous engine for scripts and notebooks, like vLLM's offline ``LLM``.

The :class:`~asyncpaged.AsyncEngine` runs on an event loop of its own, in a background thread;
each call hands its work to that loop and blocks until it is done::

    with LLM("path/to/checkpoint", num_device_blocks=256) as llm:
        outputs = llm.generate(["Hello", "The block table"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal
from tqdm import tqdm  # type: ignore[import-untyped]

from asyncpaged.config import EngineConfig
from asyncpaged.engine.async_engine import AsyncEngine
from asyncpaged.errors import EngineClosedError, InvalidRequestError
from asyncpaged.inputs import ChatMessage, PromptType
from asyncpaged.lora_request import LoRARequest
from asyncpaged.outputs import RequestOutput
from asyncpaged.sampling_params import SamplingParams
from asyncpaged.streams import RequestStream

T = TypeVar("T")


class _LoopThread:
    """An event loop (asyncio) in a daemon thread, reached through an anyio blocking portal.
    Daemon: a program that forgets ``close()`` still exits (the finalizer closes the engine)."""

    def __init__(self) -> None:
        ready = threading.Event()
        slot: list[BlockingPortal | BaseException] = []

        async def serve() -> None:
            async with BlockingPortal() as portal:
                slot.append(portal)
                ready.set()
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve, backend="asyncio")
            except BaseException as exc:  # handed to the constructor, which raises it
                slot.append(exc)
                ready.set()

        self._thread = threading.Thread(target=run, name="asyncpaged-llm", daemon=True)
        self._thread.start()
        ready.wait()
        if isinstance(slot[0], BaseException):
            raise slot[0]
        self.portal = slot[0]

    def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()`` on the loop; blocks until done. Interrupted (Ctrl-C), the task is
        cancelled on the loop (its requests are aborted) and the interruption propagates."""
        future: Future[T] = self.portal.start_task_soon(fn)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        self.portal.call(self.portal.stop)
        self._thread.join()


def _close(loop: _LoopThread, engine: AsyncEngine) -> None:
    """Close the engine, then stop its loop (the finalizer of an LLM: no reference to it)."""
    try:
        loop.run(engine.aclose)
    finally:
        loop.stop()


class LLM:
    """A synchronous front end of :class:`AsyncEngine` (vLLM's offline ``LLM``).

    ``LLM(model_or_config, **engine_kwargs)`` takes a checkpoint directory or hub id (with
    :class:`EngineConfig` fields as keywords) or an :class:`EngineConfig` (keywords then replace
    its fields) and starts the engine on its own event loop in a background thread. Calls block
    until their requests finish; exceptions propagate to the caller. Use it as a context
    manager or call :meth:`close`; the engine is closed at exit otherwise.
    """

    def __init__(self, model: EngineConfig | str | os.PathLike[str], **engine_kwargs: Any) -> None:
        if isinstance(model, EngineConfig):
            config = dataclasses.replace(model, **engine_kwargs) if engine_kwargs else model
        else:
            config = EngineConfig(model=os.fspath(model), **engine_kwargs)
        self._loop = _LoopThread()
        try:
            self.engine: AsyncEngine = self._loop.run(lambda: AsyncEngine.start(config))
        except BaseException:
            self._loop.stop()
            raise
        self._finalizer = weakref.finalize(self, _close, self._loop, self.engine)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt at once (continuously batched); returns the final outputs
        in prompt order. ``prompts`` is one prompt (a str, a list of token ids, a
        ``TextPrompt`` / ``TokensPrompt`` dict) or a list of them; ``params`` one
        :class:`SamplingParams` for all, one per prompt, or ``None`` (the model's defaults).
        ``use_tqdm`` shows a progress bar on stderr. The first error raised (an invalid
        request, a failed one) aborts the others and propagates. ``lora_request``: one adapter
        for all, or one per prompt (None: the base model)."""
        batch = _as_batch(prompts)
        per_prompt = _per_prompt(params, len(batch))
        loras: list[LoRARequest | None]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(batch)
        else:
            loras = list(lora_request)
            if len(loras) != len(batch):
                raise InvalidRequestError(
                    f"lora_request has {len(loras)} entries for {len(batch)} prompts."
                )
        return self._run_all(
            lambda: [
                self.engine.generate(p, sp, lora_request=lr)
                for p, sp, lr in zip(batch, per_prompt, loras, strict=True)
            ],
            use_tqdm,
        )

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        **chat_kwargs: Any,
    ) -> list[RequestOutput]:
        """The next message of one conversation (``[{"role": ..., "content": ...}, ...]``) or
        of each of a list of them, through the chat template; ``chat_kwargs`` are those of
        :meth:`AsyncEngine.chat`. Returns the final outputs in order."""
        conversations: list[Sequence[ChatMessage]] = (
            [messages]  # type: ignore[list-item]
            if not messages or isinstance(messages[0], Mapping)
            else list(messages)  # type: ignore[arg-type]
        )
        per_prompt = _per_prompt(params, len(conversations))
        return self._run_all(
            lambda: [
                self.engine.chat(conv, sp, **chat_kwargs)
                for conv, sp in zip(conversations, per_prompt, strict=True)
            ],
            use_tqdm,
        )

    def _run_all(self, submit: Callable[[], list[RequestStream]], use_tqdm: bool) -> list[Any]:
        if not self._finalizer.alive:
            raise EngineClosedError("the LLM is closed.")

        async def run() -> list[RequestOutput]:
            streams: list[RequestStream] = []
            try:
                for stream in submit():  # an invalid request raises here
                    streams.append(stream)
            except BaseException:
                for stream in streams:
                    await stream.aclose()
                raise
            with tqdm(total=len(streams), desc="generating", unit="req", disable=not use_tqdm,
                      dynamic_ncols=True) as bar:  # fmt: skip
                return await _gather(streams, bar)

        return self._loop.run(run)

    def close(self) -> None:
        """Abort what is unfinished, close the engine and stop its thread; again: nothing."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _gather(streams: list[RequestStream], bar: Any) -> list[RequestOutput]:
    """Every stream's final output, in order; the first failure cancels (aborts) the rest."""
    results: list[RequestOutput | None] = [None] * len(streams)
    failures: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def one(i: int) -> None:
            try:
                results[i] = await streams[i]
            except Exception as exc:
                failures.append(exc)
                tg.cancel_scope.cancel()
                return
            bar.update(1)

        for i in range(len(streams)):
            tg.start_soon(one, i)
    if failures:
        raise failures[0]
    return [r for r in results if r is not None]


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a str, a dict, a list of token ids) or a list of prompts, as a list."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [prompts]  # type: ignore[list-item]  # token ids of one prompt
    return items  # type: ignore[return-value]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * num_prompts
    per = list(params)
    if len(per) != num_prompts:
        raise ValueError(f"got {len(per)} SamplingParams for {num_prompts} prompts.")
    return list(per)
