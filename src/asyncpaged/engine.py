"""The public engine: ``async with AsyncEngine(config) as engine: await engine.generate(...)``."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from asyncpaged._detached import spawn_detached
from asyncpaged._gc import freeze_after_start, unfreeze_at_close
from asyncpaged._log import get_logger
from asyncpaged.actors.allocator import AllocatorActor
from asyncpaged.actors.executor import ExecutorActor
from asyncpaged.actors.intake import IntakeActor, thread_copy, tokenize
from asyncpaged.actors.scheduler import SchedulerActor
from asyncpaged.actors.swap_space import SwapSpaceActor
from asyncpaged.config import EngineConfig, KVShape, num_blocks_for
from asyncpaged.core.block_map import BlockMap, build_block_map
from asyncpaged.core.block_pool import BlockPool
from asyncpaged.core.block_table import PinnedPrefix
from asyncpaged.core.policy import check_priority
from asyncpaged.core.scheduler import Scheduler, SchedulerConfig
from asyncpaged.core.txn import StepTxn, TxnResult
from asyncpaged.distributed import TensorParallelRunner, check_tensor_parallel, worker_spec
from asyncpaged.engine_stats import EngineStatistics, collect_statistics
from asyncpaged.errors import EngineClosedError, EngineDeadError, InvalidRequestError
from asyncpaged.inputs import (
    ChatMessage,
    PromptType,
    check_messages,
    parse_prompt,
    truncate_prompt,
)
from asyncpaged.messages import (
    AbortRequest,
    ChatPrompt,
    ExecuteStep,
    ForgetPin,
    SchedulerInbox,
    SubmitRequest,
    SwapSpaceInbox,
    UnpinPrefix,
    WatchPin,
)
from asyncpaged.model.cpu_plan import LEVERS, CpuPlan, plan_cpu
from asyncpaged.model.draft import DraftModel, DraftProposals
from asyncpaged.model.generation_config import GenerationDefaults, load_generation_defaults
from asyncpaged.model.hub import resolve_model_path
from asyncpaged.model.kv_tier_store import KVTierStore, build_kv_tiers
from asyncpaged.model.loader import load_config, load_tokenizer, resolve_dtype, text_config
from asyncpaged.model.runner import ModelRunner, StepRunner, select_attention_backend
from asyncpaged.request_checks import (
    RequestLimits,
    check_cache_salt,
    check_group_width,
    check_request_id,
    check_text_prompt,
    max_prompt_chars,
)
from asyncpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from asyncpaged.spec_decode import NgramProposer, SpeculativeConfig
from asyncpaged.streams import RequestState, RequestStream
from asyncpaged.structured_outputs import EXTRA_HINT as STRUCTURED_EXTRA_HINT
from asyncpaged.structured_outputs import GrammarBackend
from asyncpaged.structured_outputs import is_available as structured_outputs_available

log = get_logger(__name__)


def check_draft_model(cfg: EngineConfig) -> None:
    """Refuse what the draft-model method does not support yet: tensor parallelism (the
    draft would need a shard per rank) and the KV tiers (they do not carry the draft's
    cache)."""
    spec = cfg.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    if cfg.tensor_parallel_size > 1:
        raise InvalidRequestError(
            "speculative method 'draft_model' needs tensor_parallel_size=1 (not supported with "
            "tensor parallelism yet); use 'ngram'."
        )
    if cfg.kv_offload_host_bytes:
        raise InvalidRequestError(
            "speculative method 'draft_model' does not support the KV tiers (kv_offload_*) yet."
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixHandle:
    """A pinned prefix (from :meth:`AsyncEngine.pin_prefix`)."""

    pool_pin_id: int
    num_tokens: int  # tokens in its pinned full blocks
    num_blocks: int


class AsyncEngine:
    """An LLM engine inside the caller's event loop (asyncio or trio, through anyio).

    Enter it with ``async with``, or ``engine = await AsyncEngine.start(config)`` and later
    ``await engine.aclose()`` from any task of the same loop (a notebook's cells). Closing aborts
    every unfinished request (finish reason "abort"), waits for the step and swaps in flight, and
    joins the worker threads. If the engine fails, every waiter gets :class:`EngineDeadError` (the
    cause chained) and so do ``aclose`` and the exit of the ``async with``. An engine starts once.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._tg: TaskGroup | None = None
        self._dead: BaseException | None = None
        self._closed = False
        self._live: dict[str, RequestState] = {}  # submitted; finished ones pruned lazily
        self._live_pruned_at = 64
        self._ids = itertools.count()
        self._tp: TensorParallelRunner | None = None  # tensor_parallel_size > 1
        self._tier_store: KVTierStore | None = None  # kv_offload_host_bytes > 0
        self._draft_proposals: DraftProposals | None = None  # speculative method "draft_model"
        self._dead_event = anyio.Event()  # set with _dead
        self._started = False  # start() was called: an engine starts once
        self._gc_frozen = False  # EngineConfig.gc_freeze: froze at start, unfreezes at close
        self._start_error: Exception | None = None  # the actors failed to start
        self._stop = anyio.Event()  # aclose asks the engine's own task to stop the actors
        self._owner_ready = anyio.Event()  # the actors started, or failed to
        self._owner_done = anyio.Event()  # the engine's task group has exited
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
        cfg = self.config
        path = await anyio.to_thread.run_sync(resolve_model_path, cfg.model, cfg.revision)
        self.model_path = path
        hf_config = await anyio.to_thread.run_sync(load_config, path)
        dtype = resolve_dtype(cfg.dtype, hf_config, torch.device(cfg.device))
        hf_config = text_config(hf_config)  # a multimodal checkpoint: its language model
        kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else getattr(torch, cfg.kv_cache_dtype)
        tp_size = cfg.tensor_parallel_size
        check_draft_model(cfg)
        if tp_size > 1:
            check_tensor_parallel(hf_config, tp_size)  # before any process starts
        shape = KVShape.from_hf_config(hf_config, kv_dtype.itemsize, tp_size)  # one rank's share
        num_device, num_host = num_blocks_for(cfg, shape)
        self.max_model_len = cfg.max_model_len or int(
            getattr(hf_config, "max_position_embeddings", 2048)
        )
        self.vocab_size = int(hf_config.vocab_size)
        levers = await anyio.to_thread.run_sync(self._plan_levers, hf_config, dtype)
        step_runner: StepRunner
        if tp_size > 1:
            local = dataclasses.replace(cfg, model=str(path), revision=None)
            spec = worker_spec(local, dtype, kv_dtype, num_device, num_host, levers)
            self._tp = await anyio.to_thread.run_sync(
                TensorParallelRunner.start, spec, tp_size, cfg.device
            )
            self.runner, step_runner = self._tp.runner, self._tp
        else:
            backend = await anyio.to_thread.run_sync(  # may compile (g++)
                select_attention_backend, cfg.device, cfg.attention_backend
            )
            self.runner = await anyio.to_thread.run_sync(
                lambda: ModelRunner(path, dtype, num_device, cfg.block_size, num_host,
                                    device=cfg.device, seed=cfg.seed, attn_backend=backend,
                                    kv_cache_dtype=kv_dtype,
                                    packed_linears=levers["packed_linears"],
                                    screened_lm_head=levers["screened_lm_head"],
                                    int8_lm_head=levers["int8_lm_head"],
                                    fused_elementwise=levers["fused_elementwise"])
            )  # fmt: skip
            step_runner = self.runner  # TP=1: the executor drives the runner itself
            speculative = cfg.speculative_config
            if speculative is not None and speculative.method == "draft_model":
                await anyio.to_thread.run_sync(
                    self._attach_draft, speculative, dtype, kv_dtype, num_device, num_host, levers
                )
        try:
            await self._start(hf_config, num_device, num_host, step_runner)
        except BaseException:
            await self._close_tensor_parallel(graceful=True)
            raise
        log.info("engine_started", model=cfg.model, num_device_blocks=num_device,
                 num_host_blocks=num_host, dtype=str(dtype), kv_cache_dtype=str(kv_dtype),
                 tensor_parallel_size=tp_size)  # fmt: skip
        if cfg.gc_freeze:  # the model, tokenizer and imports: out of every later GC walk
            freeze_after_start()
            self._gc_frozen = True

    def _plan_levers(self, hf_config: Any, dtype: torch.dtype) -> dict[str, bool]:
        """The CPU levers' on/off (``engine.cpu_plan`` says why); they act on float32 CPU
        models only, so elsewhere nothing is probed and "auto" is passed on as on."""
        cfg = self.config
        settings = {name: getattr(cfg, name) for name in LEVERS}
        self.cpu_plan: CpuPlan | None = None
        if torch.device(cfg.device).type != "cpu" or dtype != torch.float32:
            return {name: setting is not False for name, setting in settings.items()}
        hidden = int(hf_config.hidden_size)
        width = next((int(v) for k in ("intermediate_size", "ffn_dim", "n_inner")
                      if (v := getattr(hf_config, k, None))), 4 * hidden)  # fmt: skip
        self.cpu_plan = plan_cpu(settings, hidden_size=hidden, intermediate_size=width,
                                 vocab_size=int(hf_config.vocab_size))  # fmt: skip
        return self.cpu_plan.levers()

    async def _start(
        self, hf_config: Any, num_device: int, num_host: int, step_runner: StepRunner
    ) -> None:
        cfg = self.config
        self.tokenizer = await anyio.to_thread.run_sync(load_tokenizer, self.model_path)
        # Fast tokenizers are not re-entrant: the loop thread detokenizes with ``tokenizer``,
        # the intake's worker thread encodes (prompts, chat, pinned prefixes) with its own copy.
        self._intake_tokenizer = await anyio.to_thread.run_sync(
            thread_copy, self.tokenizer, self.model_path
        )
        self.max_prompt_chars = await anyio.to_thread.run_sync(
            max_prompt_chars, self.tokenizer, self.max_model_len
        )  # a longer text prompt cannot fit: refused by its length at generate
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.generation_defaults: GenerationDefaults = await anyio.to_thread.run_sync(
            lambda: load_generation_defaults(
                self.model_path, cfg.generation_config, tokenizer_eos=eos,
                config_eos=getattr(hf_config, "eos_token_id", None),
            )
        )  # fmt: skip
        self._eos = self.generation_defaults.eos_token_ids
        self._limits = RequestLimits(
            vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            block_size=cfg.block_size, num_device_blocks=num_device,
            max_logprobs=cfg.max_logprobs, eos_token_ids=self._eos,
        )  # fmt: skip
        self.num_device_blocks, self.num_host_blocks = num_device, num_host
        tiers, self._tier_store = None, None
        if cfg.kv_offload_host_bytes and cfg.enable_prefix_caching:
            tiers, self._tier_store = await anyio.to_thread.run_sync(
                lambda: build_kv_tiers(
                    device_cache=self.runner.kv_cache, model_path=self.model_path,
                    host_bytes=cfg.kv_offload_host_bytes, disk_dir=cfg.kv_offload_dir,
                    disk_bytes=cfg.kv_offload_disk_bytes,
                )
            )  # fmt: skip
        pool = BlockPool(num_device, num_host, block_size=cfg.block_size,
                         enable_prefix_caching=cfg.enable_prefix_caching, tiers=tiers)  # fmt: skip
        self._seq_ids = itertools.count()  # shared by intake and scheduler (one event loop)
        scheduler = Scheduler(
            SchedulerConfig(
                block_size=cfg.block_size,
                num_device_blocks=num_device,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                preemption_mode=cfg.preemption_mode if num_host else "recompute",
                watermark=cfg.watermark,
                rope_switch_len=self.runner.model.rope_switch_len,
                scheduling_policy=cfg.scheduling_policy,
                priority_aging_steps=cfg.priority_aging_steps,
                spec_disable_by_batch_size=cfg.speculative_config.disable_by_batch_size
                if cfg.speculative_config
                else None,
            ),
            new_seq_id=self._seq_ids.__next__,
            propose=self._proposer(),
        )
        self._build_actors(pool, scheduler, step_runner)
        spawn_detached(self._own)
        try:
            await self._owner_ready.wait()
        except BaseException:  # cancelled while the actors start: stop them, then propagate
            self._stop.set()
            with anyio.CancelScope(shield=True):
                await self._owner_done.wait()
            self._closed = True
            self._close_done.set()
            raise
        if self._dead is not None:
            raise EngineDeadError("the engine failed to start") from self._dead
        if self._start_error is not None:
            raise self._start_error

    async def _own(self) -> None:
        """The engine's own task (:func:`spawn_detached`): it holds the actors' task group
        from start until :meth:`aclose` sets ``_stop``, so whichever task started the engine,
        any task may close it. It never raises: a failure to start is handed to ``_open``."""
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._supervise)
                self._tg = tg
                self._owner_ready.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()
        except Exception as exc:  # an actor failed to start: _open raises it
            self._start_error = exc
        finally:
            self._owner_ready.set()
            self._owner_done.set()

    def _attach_draft(
        self,
        spec: SpeculativeConfig,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        num_device: int,
        num_host: int,
        levers: dict[str, bool],
    ) -> None:
        """Load the draft model (its own KV cache over the target's block ids) onto the
        runner (worker thread)."""
        cfg = self.config
        assert spec.model is not None
        path = resolve_model_path(spec.model, None)
        draft = DraftModel(
            path, dtype=dtype, device=self.runner.device, num_blocks=num_device,
            block_size=cfg.block_size, num_host_blocks=num_host, max_num_seqs=cfg.max_num_seqs,
            num_speculative_tokens=spec.num_speculative_tokens, kv_cache_dtype=kv_dtype,
            attn_backend=select_attention_backend(cfg.device, cfg.attention_backend),
            packed_linears=levers["packed_linears"],
            fused_elementwise=levers["fused_elementwise"], seed=cfg.seed,
        )  # fmt: skip
        self.runner.attach_draft(draft, self.max_model_len)
        log.info("draft_model_loaded", model=spec.model, num_layers=draft.model.num_layers,
                 num_scratch_blocks=draft.num_scratch_blocks)  # fmt: skip

    def _proposer(self) -> Callable[[int, list[int], int], Sequence[int]] | None:
        """Speculative decoding's proposer for the scheduler (None: no speculation): prompt
        lookup, or the draft model's proposals of the last step (``DraftProposals``, filled
        by the scheduler actor from each step's result)."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "draft_model":
            self._draft_proposals = DraftProposals()
            return self._draft_proposals.propose
        ngram = NgramProposer(spec, max_model_len=self.max_model_len)
        return lambda seq_id, token_ids, k: ngram.propose(token_ids, k)

    def _build_actors(self, pool: BlockPool, scheduler: Scheduler, runner: StepRunner) -> None:
        spec = self.config.speculative_config
        sched_send, sched_recv = anyio.create_memory_object_stream[SchedulerInbox](math.inf)
        txn_send, txn_recv = anyio.create_memory_object_stream[StepTxn](1)
        res_send, res_recv = anyio.create_memory_object_stream[TxnResult](1)
        exec_send, exec_recv = anyio.create_memory_object_stream[ExecuteStep](1)
        # Each swap in flight holds at least one block at each end: this bound is never reached.
        # (+1: a transaction's KV-tier copies, one at a time)
        swap_send, swap_recv = anyio.create_memory_object_stream[SwapSpaceInbox](
            pool.device.num_blocks + pool.host.num_blocks + 2
        )
        intake_send, intake_recv = anyio.create_memory_object_stream[SubmitRequest](math.inf)
        store = self._tier_store
        self._allocator = AllocatorActor(
            pool, txn_recv, res_send, store.take_failed_spills if store else None
        )
        self._executor = ExecutorActor(runner, exec_recv, sched_send.clone())
        self._swap_space = SwapSpaceActor(runner, swap_recv, sched_send.clone(), store)
        grammars = GrammarBackend(
            self.tokenizer, self.vocab_size, sorted(self._eos),
            jump_forward=self.config.structured_outputs_jump_forward,
        )  # fmt: skip
        self._scheduler = SchedulerActor(
            scheduler, self._allocator.snapshot(), sched_recv, txn_send, res_recv,
            exec_send, swap_send, self._eos, self.tokenizer, grammars,
            draft_proposals=self._draft_proposals,
        )  # fmt: skip
        self._intake = IntakeActor(
            self._intake_tokenizer, self._limits.check_ids, self._limits.stop_criteria, intake_recv,
            sched_send.clone(), self._seq_ids, grammars,
            on_released=self._scheduler.intake_released,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        )  # fmt: skip
        self._control = sched_send  # aborts
        self._submit = intake_send

    async def _supervise(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run the actors (and the tensor-parallel watchdog); on failure fail every waiter
        instead of cancelling the host."""
        try:
            async with anyio.create_task_group() as tg:
                for actor in (self._allocator, self._executor, self._swap_space,
                              self._scheduler, self._intake):  # fmt: skip
                    await tg.start(actor.run)
                if self._tp is not None:
                    tg.start_soon(self._tp.watch, self._fail)
                task_status.started()
        except Exception as exc:  # the engine failed: every waiter learns why
            while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Mark the engine dead and fail every waiter (the first cause wins). The watchdog calls
        it at once, before the actors have stopped: a worker's death reaches every waiter even
        while a step's thread is still unwinding."""
        if self._dead is None:
            self._dead = exc
            self._dead_event.set()
            log.error("engine_failed", error=repr(exc))
        for state in self._live.values():  # every request not yet done
            state.fail(self._dead)

    async def _close_tensor_parallel(self, *, graceful: bool) -> None:
        """Stop and join every tensor-parallel rank (shielded: runs even when cancelled)."""
        if self._tp is not None:
            tp = self._tp
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: tp.close(graceful=graceful))

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
        if self._tg is None:  # never started, or failed to start (already cleaned up)
            return
        if self._closed:  # closed, or being closed by another task
            await self._close_done.wait()
            return
        self._closed = True
        try:
            if self._dead is None:
                for state in list(self._live.values()):  # wherever it is, intake included
                    self._abort_state(state)
                with anyio.fail_after(60):
                    await self._wait_or_dead(self._scheduler.wait_idle)
                await self._persist_kv_tiers()
        finally:
            self._submit.close()
            self._control.close()
            self._stop.set()  # the engine's task cancels the actors and exits their group
            try:
                with anyio.CancelScope(shield=True):
                    await self._owner_done.wait()
            finally:
                await self._close_tensor_parallel(graceful=self._dead is None)
                if self._gc_frozen:
                    self._gc_frozen = False
                    unfreeze_at_close()
                # The stopped tasks' frames (held by their cancellation tracebacks, in cycles)
                # still reference the engine: collect them now, so that the model and KV cache
                # are freed with the engine's last reference, not at some later full collection.
                gc.collect()
                self._close_done.set()

    async def _persist_kv_tiers(self) -> None:
        """At close, with nothing running: write the cached device blocks and the host tier
        to the disk tier (docs/architecture.md, "KV tiers"), in a worker thread."""
        store = self._tier_store
        if store is None or store.disk is None:
            return
        pool = self._allocator.pool
        pool.begin_tier_txn(store.take_failed_spills())
        ops = pool.persist_tiers()
        await anyio.to_thread.run_sync(store.run, ops, abandon_on_cancel=False)

    def beam_search(
        self,
        prompt: PromptType,
        params: BeamSearchParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Beam search in the engine core: the beams of a request are sequences that fork and
        free as they go, sharing their common blocks. The stream yields one final output whose
        completions are the ``beam_width`` best hypotheses, best first (text, token ids, the
        cumulative logprob; finish reason "stop" at EOS, else "length")."""
        self._check_alive()
        sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                                  ignore_eos=params.ignore_eos, n=params.beam_width,
                                  output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        check_group_width(params.beam_width, "beam_width", self.config.max_num_seqs,
                          self.config.max_num_batched_tokens)  # fmt: skip
        parsed = parse_prompt(prompt, self.max_model_len)
        source = parsed.text if parsed.text is not None else parsed.token_ids
        assert source is not None
        salt = cache_salt if parsed.cache_salt is None else parsed.cache_salt
        return self._submit_request(source, sampling, request_id, salt, beam=params)

    async def wait_idle(self) -> None:
        """Wait until every request has finished and every block it held is free again.

        Cancelling it only stops the waiting. If the engine fails meanwhile, raises
        :class:`EngineDeadError`."""
        self._check_alive()
        await self._wait_or_dead(self._scheduler.wait_idle)
        self._check_alive()

    async def _wait_or_dead(self, wait: Callable[[], Awaitable[object]]) -> None:
        """Await ``wait()`` until it returns or the engine fails (after which it may never)."""
        async with anyio.create_task_group() as tg:

            async def stop_when_dead() -> None:
                await self._dead_event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(stop_when_dead)
            await wait()
            tg.cancel_scope.cancel()

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
        if not self.config.enable_prefix_caching:
            raise InvalidRequestError("pin_prefix needs enable_prefix_caching=True.")
        if isinstance(prefix, str):
            text = prefix
            ids = await self._intake.thread.run(tokenize, self._intake_tokenizer, text)
        else:
            ids = list(prefix)
        if len(ids) < self.config.block_size:
            raise InvalidRequestError(
                f"a pinned prefix needs at least one full block of {self.config.block_size} "
                f"tokens, got {len(ids)}."
            )
        self._check_alive()  # the tokenizing above may have outlived the engine
        pin_id = next(self._ids)
        event: anyio.Event = anyio.Event()
        slot: list[PinnedPrefix | None] = []
        self._control.send_nowait(WatchPin(pin_id=pin_id, event=event, slot=slot))
        returned = False
        try:
            params = SamplingParams(temperature=0.0, max_tokens=1)
            stream = self._submit_request(ids, params, f"pin-{pin_id}", cache_salt, pin_id)
            await stream
            await self._wait_or_dead(event.wait)  # set by the pin's transaction
            self._check_alive()
            returned = True
        finally:
            if not returned:  # refused, failed or cancelled: nobody will hold the handle
                self._release_pin(pin_id, slot)
        pinned = slot[0]
        if pinned is None:  # evicted before it could be pinned: only under extreme pressure
            raise InvalidRequestError("the prefix was evicted before it could be pinned; retry.")
        return PrefixHandle(pool_pin_id=pinned.pin_id, num_tokens=pinned.num_tokens,
                            num_blocks=len(pinned.block_ids))  # fmt: skip

    def _release_pin(self, pin_id: int, slot: list[PinnedPrefix | None]) -> None:
        """A ``pin_prefix`` call that will not return its handle: unpin what its transaction
        pinned, or tell the scheduler to unpin it when that transaction comes."""
        pinned = slot[0] if slot else None
        msg: UnpinPrefix | ForgetPin
        if pinned is not None:
            msg = UnpinPrefix(pool_pin_id=pinned.pin_id, handled=anyio.Event())
        elif not slot:
            msg = ForgetPin(pin_id=pin_id)
        else:
            return  # the transaction came and pinned nothing
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._control.send_nowait(msg)

    async def unpin_prefix(self, handle: PrefixHandle) -> None:
        """Let a pinned prefix's blocks be evicted again (they stay cached until they are).
        Returns once the scheduler has taken the unpin: a ``wait_idle`` after it waits for the
        blocks to be released."""
        self._check_alive()
        msg = UnpinPrefix(pool_pin_id=handle.pool_pin_id, handled=anyio.Event())
        self._control.send_nowait(msg)
        await self._wait_or_dead(msg.handled.wait)

    # ---- requests ---------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """The model's default sampling parameters: its ``generation_config.json`` settings
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) over vLLM's
        defaults, as vLLM's ``get_default_sampling_params``; plain ``SamplingParams()`` with
        ``generation_config="none"``."""
        self._check_alive()
        return self.generation_defaults.sampling_params()

    def _with_model_defaults(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return self.generation_defaults.sampling_params()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}."
            )
        return params.with_defaults(self.generation_defaults.sampling)

    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
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
        """
        self._check_alive()
        priority = check_priority(priority, self.config.scheduling_policy)
        params = self._with_model_defaults(params)
        truncated = params.truncate_prompt_tokens is not None
        parsed = parse_prompt(prompt, None if truncated else self.max_model_len)
        if parsed.cache_salt is not None and cache_salt is not None:
            raise InvalidRequestError("cache_salt is given twice (in the prompt and as keyword).")
        salt = cache_salt if parsed.cache_salt is None else parsed.cache_salt
        source = parsed.text if parsed.text is not None else parsed.token_ids
        assert source is not None
        return self._submit_request(source, params, request_id, salt, priority=priority)

    def chat(
        self,
        messages: Sequence[ChatMessage],
        params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
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

        A malformed conversation raises :class:`InvalidRequestError` here; a template that fails
        on it, or a rendered prompt that is too long, raises it when the stream is awaited.
        Earlier turns share their prompt's KV blocks through the prefix cache.
        """
        self._check_alive()
        checked = check_messages(messages)
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message=True needs add_generation_prompt=False."
            )
        if chat_template is not None and not isinstance(chat_template, str):
            raise InvalidRequestError("chat_template must be a str (a Jinja template).")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise InvalidRequestError("tools must be a list of dicts (JSON schemas).")
        chat = ChatPrompt(
            messages=tuple(checked),
            chat_template=chat_template,
            add_generation_prompt=bool(add_generation_prompt),
            continue_final_message=bool(continue_final_message),
            tools=None if tools is None else tuple(dict(t) for t in tools),
            chat_template_kwargs=tuple((chat_template_kwargs or {}).items()),
        )
        params = self._with_model_defaults(params)
        return self._submit_request(None, params, request_id, cache_salt, chat=chat)

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
    ) -> RequestStream:
        rid = check_request_id(
            request_id if request_id is not None else f"req-{uuid.uuid4().hex[:12]}"
        )
        check_cache_salt(cache_salt)
        if beam is None:  # sizes before any per-sequence state is built
            what = "n" if params.best_of is None else "best_of"
            check_group_width(params.num_sequences, what, self.config.max_num_seqs,
                              self.config.max_num_batched_tokens)  # fmt: skip
        if rid in self._live and not self._live[rid].is_done:
            raise InvalidRequestError(f"request id {rid!r} is already in use.")
        self._limits.check_vocab(params)
        self._limits.check_logprobs(params)
        if params.structured_outputs is not None and not structured_outputs_available():
            raise InvalidRequestError(STRUCTURED_EXTRA_HINT)
        if params.structured_outputs is not None and beam is not None:
            raise InvalidRequestError("beam search does not take structured outputs.")
        if prompt is None:
            text, ids = None, None
        elif isinstance(prompt, str):
            check_text_prompt(prompt, self.max_prompt_chars, self.max_model_len)
            text, ids = prompt, None
        else:
            ids = truncate_prompt(tuple(prompt), params)
            self._limits.check_ids(ids, params)
            text = None
        state = RequestState(rid, text, params, time.monotonic(), beam=beam is not None)
        self._live[rid] = state
        if len(self._live) >= 2 * self._live_pruned_at:  # amortized O(1) per request
            self._live = {k: v for k, v in self._live.items() if not v.is_done}
            self._live_pruned_at = max(64, len(self._live))
        self._submit.send_nowait(
            SubmitRequest(state=state, prompt=text, prompt_token_ids=ids, params=params,
                          cache_salt=cache_salt, priority=priority, pin_id=pin_id, beam=beam,
                          chat=chat)
        )  # fmt: skip
        self._scheduler.expect_request()
        return RequestStream(state, self._abort_state, self._scheduler.dropped.append)

    async def abort(self, request_id: str) -> None:
        """Abort a request (finish reason "abort"); its blocks are freed within one step.
        Unknown or finished ids are ignored, and so is every id once the engine is closed (its
        requests have all finished). Honoured wherever the request is: in intake (it is never
        scheduled), waiting, running, swapped out or in, or finishing. Returns at once;
        cancelling it has no effect."""
        state = self._live.get(request_id) if isinstance(request_id, str) else None
        if state is not None:
            self._abort_state(state)

    def _abort_state(self, state: RequestState) -> None:
        """Abort this request (not a later one that reuses its id): the flag makes the intake
        drop it if it is still there; the message reaches the scheduler otherwise (one loop,
        so one of the two sees it)."""
        if state.is_done or state.abort_requested:
            return
        state.abort_requested = True
        self._abort_nowait(state.request_id, state)

    def _abort_nowait(self, request_id: str, state: RequestState | None = None) -> None:
        if self._dead is None and self._tg is not None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                # closed: every request has finished, nothing is left to abort
                self._control.send_nowait(AbortRequest(request_id=request_id, state=state))

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine stopped") from self._dead
        if self._closed:
            raise EngineClosedError("the engine is not running: it was closed.")
        if self._tg is None:
            raise EngineClosedError(
                "the engine is not running: use `async with AsyncEngine(...)` or "
                "`await AsyncEngine.start(...)`."
            )

    # ---- statistics ---------------------------------------------------------------------------

    def block_map(self) -> BlockMap:
        """Every device and host block as of the last step: free, cached, used (by which
        requests, how many holders) or in a swap in flight (``core/block_map.py``). A pure
        snapshot, O(pool): it changes nothing."""
        self._check_alive()
        return build_block_map(self._allocator.pool, self._scheduler.scheduler.requests.values())

    def statistics(self) -> EngineStatistics:
        """The engine's counters as of the last step (docs/api.md, "Statistics")."""
        return collect_statistics(self._scheduler, self._intake)
