"""Building an engine at start, for :class:`~asyncpaged.engine.async_engine.AsyncEngine`.

What the checkpoint's config implies (dtypes, KV blocks, lengths), the CPU levers, the model
runner (in this process, or the tensor-parallel ranks) with its draft model, the tokenizers and
generation defaults, the KV tiers, the scheduler core, and the actors with the channels between
them. Each function returns what it built; the engine keeps it and starts the actors. The
async ones run their blocking work in worker threads (``anyio.to_thread``), off the event loop.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectSendStream

from asyncpaged._log import get_logger
from asyncpaged.actors.allocator import AllocatorActor
from asyncpaged.actors.draft_proposals import DraftProposals
from asyncpaged.actors.executor import ExecutorActor
from asyncpaged.actors.intake import IntakeActor, thread_copy
from asyncpaged.actors.messages import (
    ExecutorInbox,
    OutputsInbox,
    SchedulerInbox,
    StopsFound,
    SubmitRequest,
    SwapSpaceInbox,
)
from asyncpaged.actors.output_processor import OutputProcessor
from asyncpaged.actors.scheduler import SchedulerActor
from asyncpaged.actors.swap_space import SwapSpaceActor
from asyncpaged.config import (
    EngineConfig,
    KVShape,
    async_scheduling_for,
    executor_backend_for,
    num_blocks_for,
)
from asyncpaged.distributed import TensorParallelRunner, check_tensor_parallel, worker_spec
from asyncpaged.engine.lifecycle import RemoteWorkers
from asyncpaged.errors import InvalidRequestError
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.tiers import TierIndex
from asyncpaged.kv.txn import StepTxn, TxnResult
from asyncpaged.memory_budget import CudaMemory, cuda_kv_budget, cuda_memory
from asyncpaged.model.attention_select import AttentionChoice
from asyncpaged.model.cpu_plan import LEVERS, CpuPlan, plan_cpu
from asyncpaged.model.generation_config import GenerationDefaults, load_generation_defaults
from asyncpaged.model.kv_quant import KV_SCALE_DTYPE, is_quantized, kv_cache_torch_dtype
from asyncpaged.model.loader import (
    linear_shapes,
    load_config,
    load_tokenizer,
    resolve_dtype,
    stored_dtype,
    text_config,
)
from asyncpaged.reasoning import (
    ReasoningMarkers,
    get_reasoning_parser,
    reasoning_parser_for_template,
)
from asyncpaged.request_checks import RequestLimits, max_prompt_chars
from asyncpaged.sched.scheduler import Scheduler, SchedulerConfig
from asyncpaged.spec_decode import NgramProposer, SpeculativeConfig
from asyncpaged.structured_outputs import GrammarBackend
from asyncpaged.worker.draft import DraftSpec
from asyncpaged.worker.kv_tier_remote import TierStore, start_remote_tiers
from asyncpaged.worker.kv_tier_store import build_kv_tiers
from asyncpaged.worker.process import RunnerLaunch, RunnerProcess
from asyncpaged.worker.protocol import StepRunner
from asyncpaged.worker.runner import ModelRunner

__all__ = [
    "EngineActors",
    "LoadedModel",
    "ModelPlan",
    "Proposer",
    "Tokenizers",
    "build_actors",
    "build_kv_tier_store",
    "build_proposer",
    "build_scheduler",
    "check_draft_model",
    "load_model",
    "load_runner",
    "load_tokenizers",
    "plan_levers",
    "plan_model",
    "resolve_auto",
]

log = get_logger("asyncpaged.engine")  # its events are the engine's

Proposer = Callable[[int, list[int], int], Sequence[int]]


def check_draft_model(cfg: EngineConfig) -> None:
    """Refuse what the draft-model method does not support yet: the KV tiers (they do not
    carry the draft's cache). Under tensor parallelism the draft runs whole on rank 0, which
    samples and verifies."""
    spec = cfg.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    if cfg.kv_offload_host_bytes:
        raise InvalidRequestError(
            "speculative method 'draft_model' does not support the KV tiers (kv_offload_*) yet."
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPlan:
    """What the checkpoint's config implies for this engine (one rank's share under tensor
    parallelism)."""

    hf_config: Any  # the text model's config (a multimodal checkpoint: its language model)
    dtype: torch.dtype
    kv_dtype: torch.dtype
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    vocab_size: int
    # the backend the runners select from: cfg.attention_backend, or "torch" for a quantized
    # KV cache on CUDA (attention_backend_for)
    attention_backend: AttentionChoice = "auto"


def plan_model(cfg: EngineConfig, hf_config: Any, memory: CudaMemory | None = None) -> ModelPlan:
    """The dtypes, block counts and lengths, after refusing what cannot start (before any
    process starts). ``memory``: the checkpoint as :func:`cuda_kv_budget` needs it, on CUDA
    without a configured KV size."""
    dtype = resolve_dtype(cfg.dtype, hf_config, torch.device(cfg.device))
    stored = stored_dtype(hf_config)
    if cfg.dtype == "auto" and stored is not None and stored != dtype:
        # float16 / bfloat16 weights on a CPU: widened to float32, exact (docs/api.md)
        log.info("dtype_auto", stored=str(stored).removeprefix("torch."),
                 loaded=str(dtype).removeprefix("torch."),
                 hint="dtype='bfloat16' keeps the checkpoint's 16 bits: about half the memory "
                      "and faster where the CPU has bf16 dot products (cpu_plan's flags), but "
                      "not token-identical to float32 (docs/tuning.md)")  # fmt: skip
    hf_config = text_config(hf_config)  # a multimodal checkpoint: its language model
    kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, dtype)
    attention = attention_backend_for(cfg, kv_dtype)
    tp_size = cfg.tensor_parallel_size
    check_draft_model(cfg)
    if tp_size > 1:
        check_tensor_parallel(hf_config, tp_size)  # before any process starts
    scale_bytes = KV_SCALE_DTYPE.itemsize if is_quantized(kv_dtype) else 0
    shape = KVShape.from_hf_config(  # one rank's share
        hf_config, kv_dtype.itemsize, tp_size, scale_bytes=scale_bytes
    )
    max_model_len = cfg.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
    kv_bytes, draft_block = None, 0
    if memory is not None:
        kv_bytes, draft_block = cuda_kv_budget(cfg, memory, hf_config, dtype, shape, max_model_len)
    num_device, num_host = num_blocks_for(
        cfg, shape, cuda_kv_bytes=kv_bytes, extra_block_bytes=draft_block
    )
    if num_device * cfg.block_size < max_model_len:  # such requests are refused one by one
        log.warning("kv_cache_below_max_model_len", tokens=num_device * cfg.block_size,
                    max_model_len=max_model_len,
                    hint="a request whose prompt and max_tokens need more is refused; set "
                         "kv_cache_bytes or num_device_blocks (or, on CUDA, "
                         "gpu_memory_utilization) higher, or max_model_len lower")  # fmt: skip
    return ModelPlan(hf_config=hf_config, dtype=dtype, kv_dtype=kv_dtype,
                     num_device_blocks=num_device, num_host_blocks=num_host,
                     max_model_len=max_model_len, vocab_size=int(hf_config.vocab_size),
                     attention_backend=attention)  # fmt: skip


def attention_backend_for(cfg: EngineConfig, kv_dtype: torch.dtype) -> AttentionChoice:
    """The attention backend the runners select from: ``cfg.attention_backend``, but for a
    quantized KV cache (int8, fp8), which the native CPU kernels and the torch path read and the
    Triton kernels do not yet: "triton" is refused, and "auto" on CUDA takes the torch path with
    a logged reason (on the CPU it takes the native kernels, as for any cache)."""
    chosen = cfg.attention_backend
    if not is_quantized(kv_dtype) or chosen in ("torch", "cpu"):
        return chosen
    if chosen == "triton":
        raise InvalidRequestError(
            f"kv_cache_dtype={cfg.kv_cache_dtype!r}: attention_backend='triton' cannot read a "
            "quantized cache yet; use 'auto', 'cpu' (on the CPU) or 'torch'."
        )
    if torch.device(cfg.device).type != "cuda":
        return chosen
    log.warning("kv_cache_quantized_attention", kv_cache_dtype=cfg.kv_cache_dtype,
                attention_backend="torch",
                reason="the Triton kernels do not read int8 / fp8 caches yet; the torch path "
                       "dequantizes the blocks it gathers")  # fmt: skip
    return "torch"


def plan_levers(
    cfg: EngineConfig, path: Path, hf_config: Any, dtype: torch.dtype
) -> tuple[dict[str, bool], CpuPlan | None]:
    """The CPU levers' on/off, and the plan that chose them (``engine.cpu_plan`` says why);
    they act on float32 and bfloat16 CPU models only (bfloat16: the packed linears and the
    fused ops), so elsewhere nothing is probed, the plan is None and "auto" is passed on as
    on."""
    settings = {name: getattr(cfg, name) for name in LEVERS}
    if torch.device(cfg.device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return {name: setting is not False for name, setting in settings.items()}, None
    hidden = int(hf_config.hidden_size)
    width = next((int(v) for k in ("intermediate_size", "ffn_dim", "n_inner")
                  if (v := getattr(hf_config, k, None))), 4 * hidden)  # fmt: skip
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(hf_config, "head_dim", 0) or hidden // heads)
    cpu_plan = plan_cpu(settings, hidden_size=hidden, intermediate_size=width,
                        vocab_size=int(hf_config.vocab_size), head_dim=head_dim,
                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                        max_num_seqs=cfg.max_num_seqs, linear_shapes=linear_shapes(path),
                        dtype=dtype)  # fmt: skip
    return cpu_plan.levers(), cpu_plan


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    """The checkpoint found and planned for, and its runner loaded."""

    path: Path  # the checkpoint's local directory
    plan: ModelPlan
    cpu_plan: CpuPlan | None  # a float32 / bfloat16 CPU model: the levers' plan (engine.cpu_plan)
    runner: ModelRunner | None  # rank 0's under tensor parallelism; None in a runner process
    step_runner: StepRunner | RunnerProcess  # what the executor drives
    workers: RemoteWorkers | None  # tensor_parallel_size > 1, or executor_backend "process"

    @property
    def rope_switch_len(self) -> int | None:
        """The model's RoPE regime switch (longrope), for the scheduler."""
        if self.runner is not None:
            return self.runner.model.rope_switch_len
        assert isinstance(self.step_runner, RunnerProcess)
        return self.step_runner.ready.rope_switch_len


async def load_model(cfg: EngineConfig, resolve: Callable[[str, str | None], Path]) -> LoadedModel:
    """Find the checkpoint (``resolve``: the model's and the draft model's), plan for it and
    load its runner; the blocking steps run in worker threads. Nothing is left running when it
    fails: the tensor-parallel ranks start last."""
    # The runner's process first: it imports while this one finds and plans the checkpoint
    launch = None
    if cfg.executor_backend == "process":
        launch = await anyio.to_thread.run_sync(RunnerLaunch)
    try:
        path = await anyio.to_thread.run_sync(resolve, os.fspath(cfg.model), cfg.revision)
        hf_config = await anyio.to_thread.run_sync(load_config, path)
        memory = await anyio.to_thread.run_sync(cuda_memory, cfg, path, resolve)
        plan = await anyio.to_thread.run_sync(plan_model, cfg, hf_config, memory)
        levers, cpu_plan = await anyio.to_thread.run_sync(
            plan_levers, cfg, path, plan.hf_config, plan.dtype
        )
        runner, step_runner, workers = await load_runner(cfg, path, plan, levers, resolve, launch)
    finally:
        if launch is not None:
            launch.abandon()  # unless started: stopped
    return LoadedModel(path=path, plan=plan, cpu_plan=cpu_plan, runner=runner,
                       step_runner=step_runner, workers=workers)  # fmt: skip


async def load_runner(
    cfg: EngineConfig,
    path: Path,
    plan: ModelPlan,
    levers: dict[str, bool],
    resolve: Callable[[str, str | None], Path],
    launch: RunnerLaunch | None = None,
) -> tuple[ModelRunner | None, StepRunner | RunnerProcess, RemoteWorkers | None]:
    """The model runner in this process (rank 0's under tensor parallelism; None when it runs
    in a process of its own), what the executor drives (the runner itself, the
    :class:`TensorParallelRunner` that also drives the other ranks, or the
    :class:`RunnerProcess`), and the processes to watch and stop (those two). ``resolve`` finds
    the draft model's checkpoint (speculative "draft_model"); ``launch``: the runner's process,
    launched (executor_backend "process")."""
    num_device, num_host = plan.num_device_blocks, plan.num_host_blocks
    dtype, kv_dtype = plan.dtype, plan.kv_dtype
    speculative = cfg.speculative_config
    draft: DraftSpec | None = None
    if speculative is not None and speculative.method == "draft_model":
        draft = await anyio.to_thread.run_sync(draft_spec, cfg, speculative, plan, levers, resolve)
    local = dataclasses.replace(cfg, model=str(path), revision=None,
                                attention_backend=plan.attention_backend)  # fmt: skip
    spec = worker_spec(local, dtype, kv_dtype, num_device, num_host, levers,
                       max_model_len=plan.max_model_len)  # fmt: skip
    if cfg.tensor_parallel_size > 1 or cfg.executor_backend == "process":
        if cfg.executor_backend == "process":
            assert launch is not None
            proc = await anyio.to_thread.run_sync(launch.start, spec, cfg.device, draft)
            return None, proc, proc
        tp = await anyio.to_thread.run_sync(
            TensorParallelRunner.start, spec, cfg.tensor_parallel_size, cfg.device
        )
        try:
            if draft is not None:  # whole, on rank 0 only: the ranks' forwards stay the target's
                await anyio.to_thread.run_sync(tp.runner.load_draft, draft)
            await anyio.to_thread.run_sync(tp.capture_cuda_graphs, spec.cuda_graph_sizes,
                                           plan.max_model_len)  # fmt: skip
        except BaseException:
            tp.close(graceful=False)
            raise
        return tp.runner, tp, tp
    # (selecting the attention backend may compile it: g++)
    runner = await anyio.to_thread.run_sync(ModelRunner.from_spec, spec, cfg.device)
    if draft is not None:
        await anyio.to_thread.run_sync(runner.load_draft, draft)
    await anyio.to_thread.run_sync(runner.capture_cuda_graphs, spec.cuda_graph_sizes,
                                   plan.max_model_len)  # fmt: skip
    return runner, runner, None  # TP=1: the executor drives the runner itself


def draft_spec(
    cfg: EngineConfig,
    spec: SpeculativeConfig,
    plan: ModelPlan,
    levers: dict[str, bool],
    resolve: Callable[[str, str | None], Path],
) -> DraftSpec:
    """How to load the draft model (its checkpoint found with ``resolve``: blocking)."""
    assert spec.model is not None
    return DraftSpec(
        path=str(resolve(spec.model, None)), model=spec.model,
        dtype=str(plan.dtype).removeprefix("torch."),
        kv_cache_dtype=str(plan.kv_dtype).removeprefix("torch."),
        num_blocks=plan.num_device_blocks, num_host_blocks=plan.num_host_blocks,
        block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
        max_model_len=plan.max_model_len, num_speculative_tokens=spec.num_speculative_tokens,
        attention_backend=plan.attention_backend, packed_linears=levers["packed_linears"],
        fused_elementwise=levers["fused_elementwise"], seed=cfg.seed,
    )  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokenizers:
    """The tokenizers, and what is read with them at start."""

    tokenizer: Any  # the event loop's: detokenizing
    intake_tokenizer: Any  # the intake worker thread's own copy: encoding
    max_prompt_chars: int  # a longer text prompt cannot fit: refused by its length at generate
    generation_defaults: GenerationDefaults
    limits: RequestLimits  # what the model and the KV cache allow a request
    reasoning: ReasoningMarkers | None  # EngineConfig.reasoning_parser, resolved (None: none)


async def load_tokenizers(cfg: EngineConfig, path: Path, plan: ModelPlan) -> Tokenizers:
    """Load the tokenizer, its copy for the intake and the model's generation defaults (worker
    threads)."""
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, path)
    # Fast tokenizers are not re-entrant: the loop thread detokenizes with ``tokenizer``,
    # the intake's worker thread encodes (prompts, chat, pinned prefixes) with its own copy.
    intake_tokenizer = await anyio.to_thread.run_sync(thread_copy, tokenizer, path)
    max_chars = await anyio.to_thread.run_sync(max_prompt_chars, tokenizer, plan.max_model_len)
    eos = getattr(tokenizer, "eos_token_id", None)
    defaults: GenerationDefaults = await anyio.to_thread.run_sync(
        lambda: load_generation_defaults(
            path, cfg.generation_config, tokenizer_eos=eos,
            config_eos=getattr(plan.hf_config, "eos_token_id", None),
        )
    )  # fmt: skip
    limits = RequestLimits(
        vocab_size=plan.vocab_size, max_model_len=plan.max_model_len,
        block_size=cfg.block_size, num_device_blocks=plan.num_device_blocks,
        max_logprobs=cfg.max_logprobs, eos_token_ids=defaults.eos_token_ids,
    )  # fmt: skip
    return Tokenizers(tokenizer=tokenizer, intake_tokenizer=intake_tokenizer,
                      max_prompt_chars=max_chars, generation_defaults=defaults,
                      limits=limits, reasoning=reasoning_markers(cfg, tokenizer))  # fmt: skip


def reasoning_markers(cfg: EngineConfig, tokenizer: Any) -> ReasoningMarkers | None:
    """``cfg.reasoning_parser`` resolved ("auto": the one the tokenizer's chat template calls
    for, if any) with its markers tokenized; None: no reasoning parser. The choice is logged."""
    name = cfg.reasoning_parser
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None)
        name = reasoning_parser_for_template(template if isinstance(template, str) else None)
    if name is None:
        return None
    markers = ReasoningMarkers.from_tokenizer(get_reasoning_parser(name), tokenizer)
    log.info("reasoning_parser_chosen", reasoning_parser=name, configured=cfg.reasoning_parser,
             start_ids=list(markers.start_ids), end_ids=list(markers.end_ids))  # fmt: skip
    return markers


def resolve_auto(config: EngineConfig) -> EngineConfig:
    """``config`` with its "auto" executor backend and async scheduling settled (the second
    reads the first), each choice logged with its reason."""
    backend, why = executor_backend_for(config)
    if backend != config.executor_backend:
        log.info("executor_backend_chosen", executor_backend=backend, reason=why)
        config = dataclasses.replace(config, executor_backend=backend)
    ahead, why = async_scheduling_for(config)
    if ahead != config.async_scheduling:
        log.info("async_scheduling_chosen", async_scheduling=ahead, reason=why)
        config = dataclasses.replace(config, async_scheduling=ahead)
    return config


async def build_kv_tier_store(
    cfg: EngineConfig, runner: StepRunner | RunnerProcess, path: Path
) -> tuple[TierIndex | None, TierStore | None]:
    """The KV tiers' index and store (``kv_offload_host_bytes`` with prefix caching), else
    ``(None, None)``. The store lives beside the device cache: here, built in a worker thread
    (it scans the disk tier), or in the runner's process (``worker/kv_tier_remote.py``)."""
    if not (cfg.kv_offload_host_bytes and cfg.enable_prefix_caching):
        return None, None
    host, disk_dir, disk = cfg.kv_offload_host_bytes, cfg.kv_offload_dir, cfg.kv_offload_disk_bytes
    index: TierIndex
    store: TierStore
    if isinstance(runner, RunnerProcess):
        index, store = await start_remote_tiers(
            runner, model_path=path, host_bytes=host, disk_dir=disk_dir, disk_bytes=disk
        )
    else:
        assert isinstance(runner, ModelRunner), "the KV tiers take one rank (EngineConfig)"
        cache = runner.kv_cache
        index, store = await anyio.to_thread.run_sync(
            lambda: build_kv_tiers(
                device_cache=cache,
                model_path=path,
                host_bytes=host,
                disk_dir=disk_dir,
                disk_bytes=disk,
            )
        )
    log.info("kv_tiers_started", num_host_slots=index.num_host_slots,
             disk_budget_entries=index.disk_budget_entries,
             num_disk_entries=index.statistics().num_disk_entries)  # fmt: skip
    return index, store


def build_proposer(
    spec: SpeculativeConfig | None, max_model_len: int
) -> tuple[Proposer | None, DraftProposals | None]:
    """Speculative decoding's proposer for the scheduler (None: no speculation): prompt
    lookup, or the draft model's proposals of the last step (the returned
    ``DraftProposals``, filled by the scheduler actor from each step's result)."""
    if spec is None:
        return None, None
    if spec.method == "draft_model":
        proposals = DraftProposals()
        return proposals.propose, proposals
    ngram = NgramProposer(spec, max_model_len=max_model_len)
    return (lambda seq_id, token_ids, k: ngram.propose(token_ids, k)), None


def build_scheduler(
    cfg: EngineConfig,
    num_device: int,
    num_host: int,
    rope_switch_len: int | None,
    new_seq_id: Callable[[], int],
    propose: Proposer | None,
) -> Scheduler:
    """The scheduler core, configured from the engine's config and the pool's sizes."""
    return Scheduler(
        SchedulerConfig(
            block_size=cfg.block_size,
            num_device_blocks=num_device,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            preemption_mode=cfg.preemption_mode if num_host else "recompute",
            watermark=cfg.watermark,
            rope_switch_len=rope_switch_len,
            scheduling_policy=cfg.scheduling_policy,
            priority_aging_steps=cfg.priority_aging_steps,
            spec_disable_by_batch_size=cfg.speculative_config.disable_by_batch_size
            if cfg.speculative_config
            else None,
            spec_async=cfg.async_scheduling is True and cfg.speculative_config is not None,
            max_loras=cfg.max_loras if cfg.enable_lora else 0,
        ),
        new_seq_id=new_seq_id,
        propose=propose,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineActors:
    """The actors, in the order they start, and the engine's two send ends."""

    allocator: AllocatorActor
    executor: ExecutorActor
    swap_space: SwapSpaceActor
    outputs: OutputProcessor
    scheduler: SchedulerActor
    intake: IntakeActor
    control: MemoryObjectSendStream[SchedulerInbox]  # aborts and pins, to the scheduler
    submit: MemoryObjectSendStream[SubmitRequest]  # new requests, to the intake


def build_actors(
    cfg: EngineConfig,
    pool: BlockPool,
    scheduler: Scheduler,
    runner: StepRunner | RunnerProcess,
    *,
    tokenizer: Any,
    intake_tokenizer: Any,
    limits: RequestLimits,
    seq_ids: Iterator[int],
    tier_store: TierStore | None,
    draft_proposals: DraftProposals | None,
    reasoning: ReasoningMarkers | None = None,
) -> EngineActors:
    """The actors and the channels between them (none started yet); ``reasoning``: the
    engine's reasoning parser and its markers (thinking budgets; whether prompts open the
    thinking)."""
    spec = cfg.speculative_config
    eos = limits.eos_token_ids
    sched_send, sched_recv = anyio.create_memory_object_stream[SchedulerInbox](math.inf)
    txn_send, txn_recv = anyio.create_memory_object_stream[StepTxn](1)
    res_send, res_recv = anyio.create_memory_object_stream[TxnResult](1)
    # Never full (the scheduler sends without a checkpoint): at most two steps in flight and
    # one delivery of bitmasks, each taken as it comes
    exec_send, exec_recv = anyio.create_memory_object_stream[ExecutorInbox](4)
    # Each swap in flight holds at least one block at each end: this bound is never reached.
    # (+1: a transaction's KV-tier copies, one at a time)
    swap_send, swap_recv = anyio.create_memory_object_stream[SwapSpaceInbox](
        pool.device.num_blocks + pool.host.num_blocks + 2
    )
    intake_send, intake_recv = anyio.create_memory_object_stream[SubmitRequest](math.inf)
    # Unbounded: every message stands for accepted work (a prompt, a step's outputs, an end).
    out_send, out_recv = anyio.create_memory_object_stream[OutputsInbox](math.inf)
    stops_send, stops_recv = anyio.create_memory_object_stream[StopsFound](1)  # one check at a time
    outputs = OutputProcessor(out_recv, stops_send, tokenizer)
    failed_spills = tier_store.take_failed_spills if tier_store else None
    allocator = AllocatorActor(pool, txn_recv, res_send, failed_spills)
    executor = ExecutorActor(runner, exec_recv, sched_send.clone())
    swap_space = SwapSpaceActor(runner, swap_recv, sched_send.clone(), tier_store)
    grammars = GrammarBackend(
        tokenizer, limits.vocab_size, sorted(eos),
        jump_forward=cfg.structured_outputs_jump_forward,
    )  # fmt: skip
    sched_actor = SchedulerActor(
        scheduler, allocator.snapshot(), sched_recv, txn_send, res_recv,
        exec_send, swap_send, out_send.clone(), stops_recv, eos, tokenizer, grammars,
        draft_proposals=draft_proposals, async_scheduling=cfg.async_scheduling is True,
        reasoning=reasoning,
    )  # fmt: skip
    intake = IntakeActor(
        intake_tokenizer, limits.check_ids, limits.stop_criteria, intake_recv,
        sched_send.clone(), out_send, seq_ids, grammars,
        on_released=sched_actor.intake_released,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        reasoning=None if reasoning is None else reasoning.parser, loop_tokenizer=tokenizer,
    )  # fmt: skip
    return EngineActors(allocator=allocator, executor=executor, swap_space=swap_space,
                        outputs=outputs, scheduler=sched_actor, intake=intake,
                        control=sched_send, submit=intake_send)  # fmt: skip
