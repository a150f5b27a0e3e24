"""The public engine: ``async with AsyncEngine(config) as engine: await engine.generate(...)``.

This module holds the engine's state and public methods. The rest of the package: what a
start loads and builds (``build``: the model or its runner process, tokenizers, the KV plan and
tiers; ``start``: the block pool, the scheduler core and the actors over them); the checks,
shaping, queueing and abort of a request (``submit``); pinned prefixes (``prefix``); the
engine's own task, the actors' supervision, the alive check and the steps of a close
(``lifecycle``); statistics (``stats``); and the synchronous :class:`~asyncpaged.engine.llm.LLM`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio

from asyncpaged._gc import EngineGC
from asyncpaged._log import get_logger
from asyncpaged.actors.draft_proposals import DraftProposals
from asyncpaged.actors.messages import ChatPrompt
from asyncpaged.actors.output_processor import OutputProcessor
from asyncpaged.config import EngineConfig
from asyncpaged.engine.build import (
    LoadedModel,
    Proposer,
    build_kv_tier_store,
    build_proposer,
    check_draft_model,
    load_model,
    load_tokenizers,
    resolve_auto,
)
from asyncpaged.engine.lifecycle import (
    ActorTask,
    RemoteWorkers,
    check_alive,
    close_workers,
    drain,
    stop_engine,
    wait_actors_idle,
    wait_or_dead,
)
from asyncpaged.engine.lora import LoRACatalog
from asyncpaged.engine.prefix import (
    PrefixHandle,
    pin_token_ids,
    prefix_token_ids,
    unpin_handle,
)
from asyncpaged.engine.start import actor_runs, build_engine_actors, log_started
from asyncpaged.engine.stats import EngineStatistics, collect_statistics
from asyncpaged.engine.submit import (
    abort_request,
    beam_sampling_params,
    chat_prompt,
    chat_replies,
    queue_request,
    resolve_tool_parser,
    submission,
    submitted_prompt,
    with_model_defaults,
)
from asyncpaged.errors import EngineClosedError, EngineDeadError, InvalidRequestError
from asyncpaged.inputs import ChatMessage, PromptType
from asyncpaged.lora_request import LoRARequest
from asyncpaged.model.generation_config import GenerationDefaults
from asyncpaged.model.hub import resolve_model_path
from asyncpaged.reasoning import ReasoningMarkers, ReasoningParser, get_reasoning_parser
from asyncpaged.reply_parser import ReplyParsing
from asyncpaged.sampling_params import BeamSearchParams, SamplingParams
from asyncpaged.sched.block_map import BlockMap, build_block_map
from asyncpaged.sched.policy import check_priority
from asyncpaged.streams import RequestState, RequestStream
from asyncpaged.tool_choice import ToolChoice, check_tools
from asyncpaged.tool_parsers import ToolParser, get_tool_parser, tool_parser_for_template
from asyncpaged.versions import runtime_versions
from asyncpaged.worker.kv_tier_remote import TierStore
from asyncpaged.worker.process import RunnerProcess

__all__ = ["AsyncEngine", "PrefixHandle", "check_draft_model"]

log = get_logger("asyncpaged.engine")  # the engine's events, under the name hosts filter by


class AsyncEngine:
    """An LLM engine inside the caller's event loop (asyncio or trio, through anyio).

    Enter it with ``async with``, or ``engine = await AsyncEngine.start(config)`` and later
    ``await engine.aclose()`` from any task of the same loop (a notebook's cells). Closing aborts
    every unfinished request (finish reason "abort"), waits for the step and swaps in flight, and
    joins the worker threads. If the engine fails, every waiter gets :class:`EngineDeadError` (the
    cause chained) and so do ``aclose`` and the exit of the ``async with``. An engine starts once.
    """

    def __init__(self, config: EngineConfig) -> None:
        """Raises :class:`InvalidRequestError` for a ``reasoning_parser`` name that no parser
        is registered under."""
        if config.reasoning_parser not in (None, "auto"):
            get_reasoning_parser(config.reasoning_parser)
        self.config = config
        self._reasoning: ReasoningMarkers | None = None  # EngineConfig.reasoning_parser, resolved
        self._dead: BaseException | None = None
        self._lora: LoRACatalog | None = None  # the checked adapters, from the first one
        self._closed = False
        self._outputs: OutputProcessor | None = None  # the live requests' states, once started
        self._ids = itertools.count()
        # tensor-parallel ranks (tensor_parallel_size > 1) or the runner's process
        self._workers: RemoteWorkers | None = None
        self._tier_store: TierStore | None = None  # kv_offload_host_bytes > 0
        self._draft_proposals: DraftProposals | None = None  # speculative method "draft_model"
        self._dead_event = anyio.Event()  # set with _dead
        self._started = False  # start() was called: an engine starts once
        self._gc = EngineGC()  # EngineConfig.gc_freeze and gc_threshold: from start to close
        self._task = ActorTask()  # the engine's own task: holds the actors from start to close
        self._close_done = anyio.Event()  # aclose finished (a second aclose waits for it)

    # ---- lifecycle ----------------------------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """A started engine, without ``async with`` (notebooks, long-lived applications): the
        model is loaded and the actors run in a task the engine owns, so :meth:`aclose` may be
        awaited from any task of this event loop. If cancelled midway, what was started is
        stopped before the cancellation propagates."""
        engine = cls(config)
        await engine._open()
        return engine

    async def __aenter__(self) -> AsyncEngine:
        await self._open()
        return self

    async def _open(self) -> None:
        if self._started:
            raise EngineClosedError("an AsyncEngine starts only once; create a new one.")
        self._started = True
        log.info("engine_versions", **runtime_versions())
        cfg = self.config = resolve_auto(self.config)  # for every part to read
        # resolve_model_path is looked up here, at the call (the model's and the draft's)
        model = await load_model(cfg, resolve_model_path)
        self.model_path, plan = model.path, model.plan
        self.max_model_len, self.vocab_size = plan.max_model_len, plan.vocab_size
        self.cpu_plan = model.cpu_plan  # a float32 / bfloat16 CPU model: the levers' plan, and why
        # the runner in this process (None with executor_backend="process"); rank 0's under TP
        self.runner, self._workers = model.runner, model.workers
        try:
            await self._start(model)
        except BaseException:
            await close_workers(self._workers, graceful=True)
            raise
        log_started(cfg, plan)
        self._gc.start(freeze=cfg.gc_freeze, threshold=cfg.gc_threshold)

    async def _start(self, model: LoadedModel) -> None:
        cfg, plan, step_runner = self.config, model.plan, model.step_runner
        tokenizers = await load_tokenizers(cfg, self.model_path, plan)
        self.tokenizer = tokenizers.tokenizer  # the loop's; the intake encodes with its own copy
        self._intake_tokenizer = tokenizers.intake_tokenizer
        self.max_prompt_chars = tokenizers.max_prompt_chars  # longer text: refused at generate
        self.generation_defaults: GenerationDefaults = tokenizers.generation_defaults
        self._eos = self.generation_defaults.eos_token_ids
        self._limits = tokenizers.limits
        self.tool_parser = resolve_tool_parser(cfg.tool_call_parser, self.tokenizer)
        self._reasoning = tokenizers.reasoning
        self.num_device_blocks, self.num_host_blocks = plan.num_device_blocks, plan.num_host_blocks
        tiers, self._tier_store = await build_kv_tier_store(cfg, step_runner, self.model_path)
        self._seq_ids = itertools.count()  # shared by intake and scheduler (one event loop)
        propose = self._proposer()  # (and the draft model's proposals)
        actors = build_engine_actors(
            cfg, plan, step_runner, rope_switch_len=model.rope_switch_len, tiers=tiers,
            tokenizers=tokenizers, seq_ids=self._seq_ids, tier_store=self._tier_store,
            propose=propose, draft_proposals=self._draft_proposals,
        )  # fmt: skip
        self._allocator, self._executor = actors.allocator, actors.executor
        self._scheduler = actors.scheduler
        self._outputs, self._intake = actors.outputs, actors.intake
        self._control, self._submit = actors.control, actors.submit  # aborts; new requests
        try:
            await self._task.start(actor_runs(actors), self._workers, self._fail)
        except BaseException:  # cancelled while the actors start: stopped, then propagate
            self._closed = True
            self._close_done.set()
            raise
        if self._dead is not None:
            raise EngineDeadError("the engine failed to start") from self._dead
        if self._task.start_error is not None:
            raise self._task.start_error

    def _proposer(self) -> Proposer | None:
        """Speculative decoding's proposer for the scheduler (None: no speculation): prompt
        lookup, or the draft model's proposals of the last step (``DraftProposals``, filled
        by the scheduler actor from each step's result)."""
        propose, self._draft_proposals = build_proposer(
            self.config.speculative_config, self.max_model_len
        )
        return propose

    def _fail(self, exc: BaseException) -> None:
        """Mark the engine dead and fail every waiter (the first cause wins). The watchdog calls
        it at once, before the actors have stopped: a worker's death reaches every waiter even
        while a step's thread is still unwinding."""
        if self._dead is None:
            self._dead = exc
            self._dead_event.set()
            log.error("engine_failed", error=repr(exc))
        if self._outputs is not None:
            self._outputs.fail_all(self._dead)  # every request not yet done

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """:meth:`aclose`; an exception leaving the body wins over the engine's failure."""
        await self._shutdown()
        if self._dead is not None and exc is None:
            raise EngineDeadError("the engine stopped") from self._dead

    async def aclose(self) -> None:
        """Stop the engine, from any task of its event loop: abort what is unfinished, wait for
        the step and swaps in flight, stop the actors and join their threads. Closing again
        (or concurrently) waits for the first close; an engine never started is left as is.
        If the engine had failed, raises :class:`EngineDeadError` (the cause chained).

        If cancelled midway, the actors are cancelled at once and the call still waits for
        them to stop (a forward already running finishes in its thread). Tensor-parallel ranks
        are stopped and joined last, even when cancelled."""
        await self._shutdown()
        if self._dead is not None:
            raise EngineDeadError("the engine stopped") from self._dead

    async def _shutdown(self) -> None:
        if self._task.tg is None:  # never started, or failed to start (already cleaned up)
            return
        if self._closed:  # closed, or being closed by another task
            await self._close_done.wait()
            return
        self._closed = True
        try:
            if self._dead is None:
                assert self._outputs is not None
                await drain(self._outputs.live.values(), self._abort_state,
                            lambda: self._wait_or_dead(self._wait_idle), self._tier_store,
                            self._allocator.pool)  # fmt: skip
        finally:  # the actors, then the workers; the stopped tasks' frames collected
            try:
                await stop_engine(
                    (self._submit, self._control), self._task, self._workers, self._gc,
                    dead=self._dead_event, done=self._close_done,
                )  # fmt: skip
            finally:
                if self._lora is not None:  # no runner reads the adapters' snapshots any more
                    self._lora.close()

    def beam_search(
        self,
        prompt: PromptType,
        params: BeamSearchParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Beam search in the engine core: the beams of a request are sequences that fork and
        free as they go, sharing their common blocks. The stream yields one final output whose
        completions are the ``beam_width`` best hypotheses, best first (text, token ids, the
        cumulative logprob; finish reason "stop" at EOS, else "length")."""
        self._check_alive()
        sampling = beam_sampling_params(params, self.config)
        source, salt = submitted_prompt(prompt, cache_salt, self.max_model_len)
        return self._submit_request(source, sampling, request_id, salt, beam=params,
                                    lora_request=lora_request)  # fmt: skip

    async def wait_idle(self) -> None:
        """Wait until every request has finished and every block it held is free again.

        Cancelling it only stops the waiting. If the engine fails meanwhile, raises
        :class:`EngineDeadError`."""
        self._check_alive()
        await self._wait_or_dead(self._wait_idle)
        self._check_alive()

    async def _wait_idle(self) -> None:
        assert self._outputs is not None
        await wait_actors_idle(self._scheduler, self._outputs)

    async def _wait_or_dead(self, wait: Callable[[], Awaitable[object]]) -> None:
        """Await ``wait()`` until it returns or the engine fails (after which it may never)."""
        await wait_or_dead(wait, self._dead_event)

    # ---- explicit shared prefixes -------------------------------------------------------------

    async def pin_prefix(
        self, prefix: str | Sequence[int], *, cache_salt: str | None = None
    ) -> PrefixHandle:
        """Compute ``prefix`` once and pin its full blocks in the prefix cache until
        :meth:`unpin_prefix`: requests that start with it (and have the same ``cache_salt``) map
        those blocks instead of computing them. Raises :class:`InvalidRequestError` for a prefix
        shorter than one block. If cancelled midway (or failing), nothing stays pinned: the
        prefix may still be computed, and is then only cached."""
        self._check_alive()
        ids = await prefix_token_ids(prefix, self.config, self._intake, self._intake_tokenizer)
        self._check_alive()  # the tokenizing above may have outlived the engine
        return await pin_token_ids(
            ids, next(self._ids), cache_salt, control=self._control, submit=self._submit_request,
            wait_or_dead=self._wait_or_dead, check_alive=self._check_alive,
        )  # fmt: skip

    async def unpin_prefix(self, handle: PrefixHandle) -> None:
        """Let a pinned prefix's blocks be evicted again (they stay cached until they are).
        Returns once the scheduler has taken the unpin: a ``wait_idle`` after it waits for the
        blocks to be released."""
        self._check_alive()
        await unpin_handle(handle, self._control, self._wait_or_dead)

    # ---- requests ---------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """The model's default sampling parameters: its ``generation_config.json`` settings
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) over vLLM's
        defaults, as vLLM's ``get_default_sampling_params``; plain ``SamplingParams()`` with
        ``generation_config="none"``."""
        self._check_alive()
        return self.generation_defaults.sampling_params()

    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submit a request; returns its :class:`RequestStream` at once.

        ``prompt`` takes vLLM's forms: a ``str``, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}`` (``asyncpaged.inputs``). Fields of ``params`` the caller
        left unset take the model's generation defaults (``EngineConfig.generation_config``);
        ``params=None`` is :meth:`default_sampling_params`.

        Invalid input raises :class:`InvalidRequestError` here, before anything is built or
        queued (types, group width, sizes, then values; docs/api.md, "Request validation"); a
        text prompt found too long after tokenizing, or one the tokenizer fails on, raises it
        when the stream is awaited, and only there. Dropping the stream unfinished aborts it.
        ``lora_request`` runs the request with a LoRA adapter (``EngineConfig.enable_lora``;
        docs/lora.md), checked here too.
        """
        self._check_alive()
        priority = check_priority(priority, self.config.scheduling_policy)
        params = with_model_defaults(params, self.generation_defaults)
        truncated = params.truncate_prompt_tokens is not None
        limit = None if truncated else self.max_model_len
        source, salt = submitted_prompt(prompt, cache_salt, limit)
        return self._submit_request(source, params, request_id, salt, priority=priority,
                                    lora_request=lora_request)  # fmt: skip

    def chat(
        self,
        messages: Sequence[ChatMessage],
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice = None,
        parallel_tool_calls: bool = True,
        tool_call_parser: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Generate the next message of a conversation; returns the same stream as
        :meth:`generate`.

        ``messages`` (``[{"role": "user", "content": "Hi"}, ...]``) are rendered with the
        tokenizer's chat template (or ``chat_template``, a Jinja string), with ``tools`` and
        ``chat_template_kwargs`` passed to it; the prompt's token ids equal
        ``tokenizer.apply_chat_template(messages, ..., tokenize=True)``. Rendering runs in the
        intake's worker thread, off the event loop. ``continue_final_message`` continues the last
        (assistant) message instead of starting a new one; it needs
        ``add_generation_prompt=False``, as in transformers and vLLM.

        Tool calls and reasoning (docs/api.md, "Tool calls and reasoning"): with ``tools`` (OpenAI's
        ``[{"type": "function", "function": {"name", "parameters", ...}}]``) the reply's calls
        are parsed into ``outputs[i].tool_calls`` by the engine's tool parser
        (``EngineConfig.tool_call_parser``, or ``tool_call_parser`` here) and the turn ends with
        finish reason ``"tool_calls"``; ``tool_choice`` is ``"none"``, ``"auto"`` (the default
        with a parser), ``"required"`` or ``{"type": "function", "function": {"name": ...}}``,
        the last two enforced by a grammar so the calls always parse and their arguments
        validate; ``parallel_tool_calls=False`` allows one call where a grammar applies. The
        engine's reasoning parser puts the thinking in ``outputs[i].reasoning``.

        A malformed conversation or tools raise :class:`InvalidRequestError` here; a template
        that fails on it, or a rendered prompt that is too long, raises it when the stream is
        awaited. Earlier turns share their prompt's KV blocks through the prefix cache.
        """
        self._check_alive()
        checked_tools = check_tools(tools)
        parser = self._tool_parser_for(tool_call_parser, chat_template)
        params = with_model_defaults(params, self.generation_defaults)
        parsing, grammar, params = chat_replies(
            checked_tools, tool_choice, params, parallel_tool_calls=parallel_tool_calls,
            tool_parser=parser, reasoning=self.reasoning_parser,
        )  # fmt: skip
        chat = chat_prompt(messages, chat_template, add_generation_prompt, continue_final_message,
                           checked_tools, chat_template_kwargs, grammar)  # fmt: skip
        return self._submit_request(None, params, request_id, cache_salt, chat=chat,
                                    reply_parsing=parsing, lora_request=lora_request)  # fmt: skip

    def _tool_parser_for(
        self, name: str | None, chat_template: str | None
    ) -> type[ToolParser] | None:
        """The tool parser of a chat request: the one named, else the engine's (for a request's
        own chat template under ``tool_call_parser="auto"``: the one that template implies)."""
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequestError("tool_call_parser must be a parser's name.")
            return get_tool_parser(name)
        if chat_template is not None and self.config.tool_call_parser == "auto":
            implied = tool_parser_for_template(chat_template)
            return None if implied is None else get_tool_parser(implied)
        return self.tool_parser

    def _submit_request(
        self,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
        pin_id: int | None = None,
        beam: BeamSearchParams | None = None,
        chat: ChatPrompt | None = None,
        priority: int = 0,
        reply_parsing: ReplyParsing | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a checked request for the intake (``submit.submission``); its state
        is registered with the output processor first."""
        outputs = self._outputs
        assert outputs is not None
        lora = None if lora_request is None else self._resolve_lora(lora_request)
        msg = submission(
            prompt, params, request_id, cache_salt, pin_id=pin_id, beam=beam, chat=chat,
            priority=priority, live=outputs.live, cfg=self.config, limits=self._limits,
            max_prompt_chars=self.max_prompt_chars, reply_parsing=reply_parsing,
            has_reasoning_parser=self._reasoning is not None, lora=lora,
        )  # fmt: skip
        return queue_request(msg, outputs, self._submit, self._scheduler, self._abort_state)

    def _resolve_lora(self, lora_request: LoRARequest) -> tuple[str, str]:
        """The adapter's digest and snapshot (``engine/lora.py``), or InvalidRequestError."""
        if not self.config.enable_lora:
            raise InvalidRequestError("lora_request needs EngineConfig(enable_lora=True).")
        if self._lora is None:
            self._lora = LoRACatalog(os.fspath(self.model_path), self.config.max_lora_rank)
        return self._lora.resolve(lora_request)

    async def abort(self, request_id: str) -> None:
        """Abort a request (finish reason "abort"); its blocks are freed within one step.
        Unknown or finished ids are ignored, and so is every id once the engine is closed (its
        requests have all finished). Honoured wherever the request is: in intake (it is never
        scheduled), waiting, running, swapped out or in, or finishing. Returns at once;
        cancelling it has no effect."""
        live = self._outputs.live if self._outputs is not None else {}
        state = live.get(request_id) if isinstance(request_id, str) else None
        if state is not None:
            self._abort_state(state)

    def _abort_state(self, state: RequestState) -> None:
        """Abort this request, not a later one that reuses its id (``abort_request``)."""
        running = self._dead is None and self._task.tg is not None
        abort_request(state, self._control, running=running)

    def _check_alive(self) -> None:
        check_alive(self._dead, closed=self._closed, running=self._task.tg is not None)

    @property
    def reasoning_parser(self) -> type[ReasoningParser] | None:
        """The reasoning parser class the engine resolved at start
        (``EngineConfig.reasoning_parser``; "auto": the one the chat template calls for), or
        None: no reasoning parser (then ``thinking_token_budget`` is refused). Whether a
        request's prompt opened the thinking is its ``RequestState.in_reasoning_at_start``."""
        return None if self._reasoning is None else self._reasoning.parser

    # ---- statistics ---------------------------------------------------------------------------

    @property
    def runner_pid(self) -> int | None:
        """The process id of the runner's own process (``executor_backend="process"``, once
        started), else None: its CPU time and memory are not this process's (the KV cache
        lives there), so a monitor reads them there too (``asyncpaged.tools.proc_stats``)."""
        workers = self._workers
        return workers.pid if isinstance(workers, RunnerProcess) else None

    def block_map(self) -> BlockMap:
        """Every device and host block as of the last step: free, cached, used (by which
        requests, how many holders) or in a swap in flight (``sched/block_map.py``). A pure
        snapshot, O(pool): it changes nothing."""
        self._check_alive()
        return build_block_map(self._allocator.pool, self._scheduler.scheduler.requests.values())

    def statistics(self) -> EngineStatistics:
        """The engine's counters as of the last step (docs/api.md, "Statistics")."""
        return collect_statistics(self._scheduler, self._intake)
