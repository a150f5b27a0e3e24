"""Engine configuration: what to load and how much memory and batching to allow."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from asyncpaged.errors import InvalidRequestError
from asyncpaged.spec_decode.config import SpeculativeConfig

KVCacheDtype = Literal[
    "auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"
]
#: ``EngineConfig.kv_cache_dtype``'s values: "auto" (the model's dtype), a float dtype, or a
#: quantized one (one byte per value and a scale per token and KV head; "fp8" is e4m3).
KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"
)  # fmt: skip
DEFAULT_KV_CACHE_BYTES = 256 * 2**20
DEFAULT_SWAP_SPACE_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Settings of an :class:`~asyncpaged.AsyncEngine`.

    KV memory: ``num_device_blocks`` wins over ``kv_cache_bytes``; with neither, 256 MiB on a
    CPU, and on CUDA what ``gpu_memory_utilization`` (vLLM's, 0.9: the share of the device's
    memory this engine may use) leaves after the weights and a reserve for a step's activations
    (``asyncpaged.memory_budget``; the ``kv_budget`` log line says how it split). The
    host (swap) pool is ``swap_space_bytes`` (64 MiB by default; 0 disables swapping, and
    preemption then always recomputes). ``max_model_len`` defaults to the model's
    ``max_position_embeddings``. ``watermark`` is the share of device blocks kept free when
    admitting new requests, so that running ones rarely need preempting right after.

    ``packed_linears``, ``screened_lm_head``, ``int8_lm_head``, ``fused_elementwise`` and
    ``native_bf16_decode`` are the CPU levers (docs/tuning.md): speed-ups of the CPU path.
    ``"auto"`` (the default) uses each where this CPU runs it bit-identically to the reference
    path (transformers' torch code) and faster (``asyncpaged.model.cpu_plan``: an exactness
    check and a timed probe on this CPU; ``engine.cpu_plan`` says what was chosen and why);
    ``True`` forces one on, its speed for transformers' bits where it is not exact; ``False``
    forces it off. They do nothing elsewhere.
    ``kv_cache_dtype`` stores K/V in another dtype than the model's ("auto"): "bfloat16" halves KV
    memory and decode-attention bytes but is not bit-exact (attention math stays float32).
    "int8", "fp8_e4m3" ("fp8", as in vLLM) and "fp8_e5m2" quantize K/V to one byte per value with
    a bfloat16 scale per (token, KV head) (``asyncpaged.model.kv_quant``; docs/quantized.md, "KV
    cache"): about 2x the tokens of a bfloat16 cache in the same ``kv_cache_bytes``, 4x those of
    float32; attention dequantizes (float32 math) on the torch attention path.

    ``tensor_parallel_size`` > 1 splits the model over that many ranks (docs/distributed.md):
    spawned worker processes, or the ranks of a ``torchrun`` launch. Every rank holds the same
    blocks with its share of the KV heads, so ``kv_cache_bytes`` and ``swap_space_bytes`` are
    budgets *per rank* (as in vLLM): the same budget holds N times the blocks.

    ``speculative_config`` turns on speculative decoding (``SpeculativeConfig``: n-gram prompt
    lookup or a draft model proposes, the target verifies; the output distribution is unchanged).
    """

    # A checkpoint directory or a hub id ("org/name") in the Hugging Face cache; a path
    # (os.PathLike, such as default_model.path()) is stored as its str
    model: str | os.PathLike[str]
    revision: str | None = None  # hub ids: the branch, tag or commit of the snapshot
    # "auto": the checkpoint's generation_config.json gives the EOS ids and the sampling
    # defaults of unset SamplingParams fields; "none": neither; a directory: its file instead
    generation_config: str = "auto"
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_device_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA without a KV size: see the docstring
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    seed: int = 0
    # The most SamplingParams.logprobs / prompt_logprobs may ask for (vLLM's); -1: no limit
    max_logprobs: int = 20
    # auto: Triton on CUDA; on CPU the native C++ decode kernel if it builds, else torch
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    kv_cache_dtype: KVCacheDtype = "auto"  # auto: model's
    packed_linears: bool | Literal["auto"] = "auto"  # CPU fp32/bf16: oneDNN pre-packed weights
    screened_lm_head: bool | Literal["auto"] = "auto"  # CPU fp32: greedy / top-k via a bf16 screen
    int8_lm_head: bool | Literal["auto"] = "auto"  # CPU fp32: all-greedy steps via an int8 screen
    # CPU: native fused residual add + RMSNorm, RoPE, SiLU x up (Llama family); not bit-identical
    # (FMA, the norm's sum order), so "auto" leaves them off unless this CPU's check finds them so
    fused_elementwise: bool | Literal["auto"] = "auto"
    # CPU bf16: decodes on the native paged kernel (fp32 math, 2-4x faster per step on small
    # models) instead of torch's bf16 SDPA per sequence (transformers' call and bits); "auto": off
    native_bf16_decode: bool | Literal["auto"] = "auto"
    tensor_parallel_size: int = 1  # ranks the model is split over (torch.distributed)
    # Where the model runner runs: "thread", a worker thread of this process; "process", a
    # child process of its own, so the forward computes while the event loop runs Python (no
    # GIL between them; docs/tuning.md). "process" takes no tensor parallelism or per-request
    # logits_processors, and needs POSIX (the KV tiers' store then lives in that process).
    # "auto" (executor_backend_for): "process" on a CPU or CUDA device with 2+ usable cores
    # where it can, else "thread"; the environment variable ASYNCPAGED_EXECUTOR_BACKEND=
    # thread|process decides "auto" instead. "auto" is the default: with async scheduling the
    # process measured faster on both CPU workloads and on an H100 (docs/benchmarks.md,
    # "Engine overhead per step"); choose "thread" for per-request logits_processors.
    executor_backend: Literal["auto", "thread", "process"] = "auto"
    # Async scheduling (vLLM's async_scheduling): plan step N+1 while step N runs, so the executor
    # goes from one step to the next without waiting for the loop; a row whose input is step N's
    # token takes it in the runner. A step is planned ahead only when no request step N samples has
    # beams (one that fans out in step N, n > 1, sits step N+1 out: its sequences exist once step N
    # is back); else the engine waits for step N. The runner adds step N's token to a penalty
    # history itself, and what else a row's sampling reads of it (a grammar's bitmask; bad words,
    # min_tokens and logits processors, which read the output) is made once step N is back and taken
    # by the runner just before it samples (worker/late_inputs.py). A row planned ahead for a
    # sequence that step N's token ends (a stop token, EOS or a stop string), or after which a
    # grammar forces tokens (jump-forward), is computed and discarded. A plan ahead preempts nothing
    # (a priority preemption included): it waits for step N instead; so do the KV tiers' copies of a
    # plan ahead. Under tensor parallelism rank 0 sends the other ranks step N's tokens with step
    # N+1. With speculative decoding a step goes ahead only where step N verifies no proposals and
    # no sequence it samples would propose next (their proposals follow step N's token): the steps
    # between proposals go ahead (a miss of the proposer backs off then, aligned so that sequences
    # propose on the same steps). "auto" (async_scheduling_for): on with the runner in its own
    # process (it measured faster there, on CPUs and an H100, with speculative decoding too), off
    # with the thread (no gain measured on CPUs: the forward and the loop share the GIL) and on
    # devices other than CPU and CUDA (not measured).
    async_scheduling: bool | Literal["auto"] = "auto"
    # Structured outputs: append the tokens a grammar forces (a schema's keys, punctuation)
    # without sampling each one; they are computed in the next step like a prefill chunk
    structured_outputs_jump_forward: bool = True
    # The format chat replies' tool calls are parsed from (asyncpaged.tool_parsers: "hermes",
    # "llama3_json", "mistral", "pythonic" or one registered by the host): "auto" takes it from
    # the chat template where that is unambiguous, None parses no calls; engine.chat's
    # tool_call_parser overrides it per request
    tool_call_parser: str | None = "auto"
    # GGUF and compressed-tensors int4 / int8 weights (docs/quantized.md): "float32" multiplies
    # the model's activations in float32 (exact: transformers' dequantized model, up to summation
    # order); "int8" quantizes them per weight block or group first and sums in integers, as
    # llama.cpp does (faster, not exact); fp8 weights multiply float32 either way
    quantized_activations: Literal["float32", "int8"] = "float32"
    # gc.freeze() once started (every object alive then leaves the cyclic GC's walks, which
    # otherwise stall the host loop 100+ ms), gc.unfreeze() when the last such engine closes
    gc_freeze: bool = True
    # While an engine runs, the cyclic GC's young collections come every gc_threshold new
    # container objects at least (gc.set_threshold's first value; the host's own where it is
    # higher, or 0), not every 700: a step makes thousands, and each young pass walks what is
    # still alive (the passes took ~9% of the loop's CPU at 256 sequences; docs/benchmarks.md
    # "Engine overhead per step"). The host's thresholds come back when the last such engine
    # closes. None: leave them alone.
    gc_threshold: int | None = 10_000
    # Queue order (sched/policy.py): "fcfs", or "priority" (generate(priority=N): lower first,
    # FCFS among equals; a waiting request preempts lower-ranked running ones; every
    # priority_aging_steps plans spent waiting improve its effective priority by 1)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    priority_aging_steps: int = 64
    # KV tiers below the device prefix cache (docs/architecture.md, "KV tiers"): evicted full
    # blocks go to host RAM (kv_offload_host_bytes), from there to files in kv_offload_dir
    # (kv_offload_disk_bytes); a later prefix lookup brings them back instead of recomputing
    kv_offload_host_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 0
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    # CUDA graphs (vLLM's): a decode-only step of up to max_cudagraph_capture_size sequences
    # (None: max_num_seqs, at most 512) replays a graph captured at start for the next size of
    # 1, 2, 4, 8, 16, 24, ... (padded), so the host launches one graph instead of every
    # kernel (``worker/cuda_graphs.py``; under tensor parallelism every rank captures and
    # replays its shard's graphs). Used on a CUDA device with the Triton attention backend,
    # for families that keep rows apart and read nothing back on the host (not MoE);
    # elsewhere the forward runs eagerly. True: always eager.
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None
    # Reasoning models (asyncpaged.reasoning; docs/api.md, "Reasoning models"): the parser
    # whose markers (<think>, </think>) the engine knows, for SamplingParams.thinking_token_budget
    # and for splitting replies. "auto": the one the tokenizer's chat template calls for
    # (reasoning_parser_for_template; none for a model that does not think); a registered
    # name ("qwen3", "deepseek_r1"); None: none.
    reasoning_parser: str | None = "auto"
    # LoRA (docs/lora.md, vLLM's names): generate(..., lora_request=LoRARequest(...)) runs a
    # request with a PEFT adapter. max_loras adapters sit in device slots (a step holds rows of
    # at most that many, besides the base model's); up to max_cpu_loras (None: max_loras) more
    # stay read in host memory (LRU); an adapter's rank is at most max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        checks = [
            (isinstance(self.model, str) and bool(self.model),
             f"model must be a checkpoint directory or a hub id, got {self.model!r}."),
            (self.revision is None or (isinstance(self.revision, str) and bool(self.revision)),
             f"revision must be a non-empty str or None, got {self.revision!r}."),
            (isinstance(self.generation_config, str) and bool(self.generation_config),
             f"generation_config must be 'auto', 'none' or a directory, got "
             f"{self.generation_config!r}."),
            (self.block_size >= 1, f"block_size must be at least 1, got {self.block_size}."),
            (self.num_device_blocks is None or self.num_device_blocks >= 1,
             f"num_device_blocks must be at least 1, got {self.num_device_blocks}."),
            (self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
             f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}."),
            (0.0 < self.gpu_memory_utilization <= 1.0,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."),
            (self.swap_space_bytes >= 0,
             f"swap_space_bytes must be non-negative, got {self.swap_space_bytes}."),
            (self.preemption_mode in ("recompute", "swap"),
             f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}."),
            (self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}."),
            (self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."),
            (self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be at least 2, got {self.max_model_len}."),
            (0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}."),
            (self.max_logprobs >= -1,
             f"max_logprobs must be -1 (no limit) or at least 0, got {self.max_logprobs}."),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got "
             f"{self.kv_cache_dtype!r}."),
            (self.tensor_parallel_size >= 1,
             f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}."),
            *((getattr(self, lever) in (True, False, "auto"),
               f"{lever} must be True, False or 'auto', got {getattr(self, lever)!r}.")
              for lever in ("packed_linears", "screened_lm_head", "int8_lm_head",
                            "fused_elementwise", "native_bf16_decode")),
            (self.scheduling_policy in ("fcfs", "priority"),
             f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}."),
            (self.gc_threshold is None
             or (isinstance(self.gc_threshold, int) and self.gc_threshold >= 1),
             f"gc_threshold must be a positive int or None, got {self.gc_threshold!r}."),
            (isinstance(self.priority_aging_steps, int) and self.priority_aging_steps >= 1,
             f"priority_aging_steps must be at least 1, got {self.priority_aging_steps!r}."),
            (self.kv_offload_host_bytes >= 0,
             f"kv_offload_host_bytes must be non-negative, got {self.kv_offload_host_bytes}."),
            (self.kv_offload_disk_bytes >= 0,
             f"kv_offload_disk_bytes must be non-negative, got {self.kv_offload_disk_bytes}."),
            ((self.kv_offload_dir is None) == (self.kv_offload_disk_bytes == 0),
             "kv_offload_dir and kv_offload_disk_bytes go together (a directory and a positive "
             f"budget, or neither), got {self.kv_offload_dir!r} and {self.kv_offload_disk_bytes}."),
            (self.kv_offload_dir is None or self.kv_offload_host_bytes > 0,
             "the disk tier is filled from the host tier: kv_offload_dir needs "
             "kv_offload_host_bytes > 0."),
            (self.kv_offload_host_bytes == 0 or self.enable_prefix_caching,
             "kv_offload_host_bytes needs enable_prefix_caching=True."),
            (self.kv_offload_host_bytes == 0 or self.tensor_parallel_size == 1,
             "the KV tiers (kv_offload_*) need tensor_parallel_size=1."),
            (self.executor_backend in ("auto", "thread", "process"),
             "executor_backend must be 'auto', 'thread' or 'process', got "
             f"{self.executor_backend!r}."),
            (self.executor_backend != "process" or self.tensor_parallel_size == 1,
             "executor_backend='process' needs tensor_parallel_size=1."),
            (isinstance(self.enable_lora, bool),
             f"enable_lora must be True or False, got {self.enable_lora!r}."),
            (isinstance(self.max_loras, int) and self.max_loras >= 1,
             f"max_loras must be an int >= 1, got {self.max_loras!r}."),
            (isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1,
             f"max_lora_rank must be an int >= 1, got {self.max_lora_rank!r}."),
            (self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int)
                                            and self.max_cpu_loras >= self.max_loras),
             f"max_cpu_loras must be None or at least max_loras ({self.max_loras}), got "
             f"{self.max_cpu_loras!r}."),
            (not self.enable_lora or self.tensor_parallel_size == 1,
             "enable_lora needs tensor_parallel_size=1 (LoRA is not sharded yet)."),
            (self.executor_backend != "process" or os.name == "posix",
             "executor_backend='process' needs a POSIX system."),
            (self.async_scheduling in (True, False, "auto"),
             f"async_scheduling must be True, False or 'auto', got {self.async_scheduling!r}."),
            (isinstance(self.enforce_eager, bool),
             f"enforce_eager must be True or False, got {self.enforce_eager!r}."),
            (self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size >= 1,
             "max_cudagraph_capture_size must be at least 1 or None, got "
             f"{self.max_cudagraph_capture_size}."),
            (self.quantized_activations in ("float32", "int8"),
             "quantized_activations must be 'float32' or 'int8', got "
             f"{self.quantized_activations!r}."),
            (self.tool_call_parser is None or (isinstance(self.tool_call_parser, str)
                                                and bool(self.tool_call_parser)),
             f"tool_call_parser must be a parser's name, 'auto' or None, got "
             f"{self.tool_call_parser!r}."),
            (self.reasoning_parser is None
             or (isinstance(self.reasoning_parser, str) and bool(self.reasoning_parser)),
             "reasoning_parser must be 'auto', a reasoning parser's name or None, got "
             f"{self.reasoning_parser!r}."),
            (self.attention_backend in ("auto", "torch", "triton", "cpu"),
             f"attention_backend must be 'auto', 'torch', 'triton' or 'cpu', got "
             f"{self.attention_backend!r}."),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class KVShape:
    """What one KV block costs for a model: K and V of every layer (a quantized cache's:
    ``dtype_bytes`` per value and ``scale_bytes`` per token and KV head for each of K and V)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    scale_bytes: int = 0

    def block_bytes(self, block_size: int) -> int:
        row_bytes = self.head_dim * self.dtype_bytes + self.scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * block_size * row_bytes

    @classmethod
    def from_hf_config(
        cls, config: Any, dtype_bytes: int, tensor_parallel_size: int = 1, scale_bytes: int = 0
    ) -> KVShape:
        """One rank's block: its share of the KV heads (all of them without tensor parallelism;
        the engine checks divisibility before it gets here)."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        kv_heads = kv_head_replicas(kv_heads, tensor_parallel_size)[0]
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=dtype_bytes,
            scale_bytes=scale_bytes,
        )


EXECUTOR_BACKEND_ENV = "ASYNCPAGED_EXECUTOR_BACKEND"


def executor_backend_for(config: EngineConfig) -> tuple[Literal["thread", "process"], str]:
    """Where the runner runs for ``config``, and why: its ``executor_backend`` unless "auto".

    "auto" takes the environment's ``ASYNCPAGED_EXECUTOR_BACKEND`` ("thread" or "process") if
    set, then "thread" where the runner cannot leave this process (tensor parallelism, no
    POSIX) or where it is not measured to win (a device other than CPU and CUDA; a single
    usable core: the two processes would take turns on it), else "process"."""
    chosen = config.executor_backend
    if chosen != "auto":
        return chosen, "configured"
    env = os.environ.get(EXECUTOR_BACKEND_ENV, "")
    if env not in ("", "thread", "process"):
        raise InvalidRequestError(
            f"{EXECUTOR_BACKEND_ENV} must be 'thread' or 'process', got {env!r}."
        )
    if config.tensor_parallel_size > 1:
        return "thread", "tensor parallelism drives its ranks from this process"
    if os.name != "posix":
        return "thread", "the runner process needs POSIX"
    if env:
        return env, EXECUTOR_BACKEND_ENV  # type: ignore[return-value]
    if not _measured_device(config.device):
        return "thread", f"not measured on {config.device!r} yet"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) < 2:
        return "thread", "one usable core: the loop and the runner would take turns on it"
    return "process", f"{cores} usable cores: the forward runs beside the event loop"


def _measured_device(device: str) -> bool:
    """Where the runner's process (with async scheduling) measured faster than its thread:
    CPUs and CUDA (an H100's host: 2.6 against 4.1-4.3 ms per step of ``bench overhead``;
    docs/benchmarks.md, "Engine overhead per step")."""
    return device.partition(":")[0] in ("cpu", "cuda")


def num_blocks_for(
    config: EngineConfig,
    shape: KVShape,
    *,
    cuda_kv_bytes: int | None = None,
    extra_block_bytes: int = 0,
) -> tuple[int, int]:
    """(device blocks, host blocks) for this config and model. ``cuda_kv_bytes``: the budget
    ``gpu_memory_utilization`` leaves (``memory_budget``), whose blocks also pay
    ``extra_block_bytes`` each (a draft model's cache holds as many)."""
    per_block = shape.block_bytes(config.block_size)
    if config.num_device_blocks is not None:
        device = config.num_device_blocks
    elif cuda_kv_bytes is not None:
        device = max(1, cuda_kv_bytes // (per_block + extra_block_bytes))
    else:
        device = max(1, (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_block)
    host = config.swap_space_bytes // per_block
    return device, host


def kv_head_replicas(num_kv_heads: int, world_size: int) -> tuple[int, int]:
    """(KV heads per rank, ranks that hold each one) under tensor parallelism: each rank its
    ``1 / world_size`` share, or, with fewer KV heads than ranks and ``world_size`` a multiple
    of them, one head each, held by ``world_size / num_kv_heads`` ranks (vLLM replicates them
    the same way). Other counts do not split: the share is ``num_kv_heads / world_size``
    rounded down (``TensorShard.kv_heads`` refuses them)."""
    if num_kv_heads < world_size and world_size % num_kv_heads == 0:
        return 1, world_size // num_kv_heads
    return num_kv_heads // world_size, 1


def cuda_graph_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The decode batch sizes ``config`` captures in CUDA graphs (vLLM's: 1, 2, 4, then every
    multiple of 8, and the largest itself); () where they do not apply: ``enforce_eager``, a
    device other than CUDA or the torch attention backend. The runner may still find the
    model unfit (``cuda_graphs.capture_decode_graphs``)."""
    if (
        config.enforce_eager
        or not config.device.startswith("cuda")
        or config.attention_backend == "torch"
    ):
        return ()
    top = config.max_cudagraph_capture_size or min(config.max_num_seqs, 512)
    sizes = {n for n in (1, 2, 4) if n <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def async_scheduling_for(config: EngineConfig) -> tuple[bool, str]:
    """Whether ``config`` plans steps ahead, and why: its ``async_scheduling`` unless "auto",
    which needs ``executor_backend`` settled (:func:`executor_backend_for`)."""
    chosen = config.async_scheduling
    if chosen != "auto":
        return bool(chosen), "configured"
    if config.executor_backend != "process":
        return False, "the runner's thread shares the GIL with the loop: no gain measured"
    if not _measured_device(config.device):
        return False, f"not measured on {config.device!r} yet"
    return True, "the runner's process goes from step to step without waiting for the loop"
