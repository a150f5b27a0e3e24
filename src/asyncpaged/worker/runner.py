"""The model runner: holds the model and its KV caches (``instance``), executes one scheduled step
at a time.

A step (``StepPlan``, ``worker/protocol.py`` with the other records) lists, per sequence, the new
tokens to run, where their K/V go (slots), the changes to the sequence's block table (the runner
keeps the tables: ``input_batch``), and whether the sequence samples this step. Sequences are
concatenated into one flat batch with no padding; prefill, prefill chunks and decodes mix
freely in one step. The attention backend is chosen in ``attention_select``.

Order inside ``execute``: copy-on-write pairs, then the forward (which writes the new K/V into
their slots), then the full fp32 head over the prompt rows that want prompt logprobs, if any
(``prompt_logprobs``), then the verification of speculative proposals, if any, and the LM head
only for the sampling rows (each sampling sequence's last new token) with the sampler, both
through a screened head where one applies (``step_sampling``). Swap copies are separate calls
(``swap_out`` / ``swap_in``) so a swap worker can run them beside steps; the scheduler
guarantees they never touch blocks of a scheduled sequence.

Tensor parallel: a runner built with a ``TensorShard`` holds one rank's shard of the weights and
a KV cache with that rank's share of the KV heads (the same block ids as every other rank). Rank 0
runs ``execute`` (it samples); the other ranks run ``execute_forward`` on the same plan, which
does everything but the LM head and sampling (``asyncpaged.distributed`` drives them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from asyncpaged._log import get_logger
from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
from asyncpaged.model.attention import AttentionBackend, AttentionMetadata
from asyncpaged.model.attention_select import AttentionChoice, select_attention_backend
from asyncpaged.model.base import SINGLE_SHARD, CausalLM, TensorShard
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.lm_head import ScreenedLMHead
from asyncpaged.model.lm_head_int8 import Int8ScreenedArgmax, int8_activation_limit
from asyncpaged.model.lora_layers import LoRAWeights
from asyncpaged.model.packed_linear import pack_weight
from asyncpaged.sampling.options import SeenTokens
from asyncpaged.worker.cuda_graphs import Capture, DecodeGraphs
from asyncpaged.worker.draft import DraftModel, DraftSpec
from asyncpaged.worker.input_batch import InputBatch, ResolvedRows
from asyncpaged.worker.instance import ModelInstance
from asyncpaged.worker.late_inputs import LateInputs, LateSource, with_late_inputs
from asyncpaged.worker.prompt_logprobs import compute_prompt_logprobs
from asyncpaged.worker.protocol import (
    LateDelivery,
    SampledToken,
    SequenceStep,
    StepPlan,
    StepResult,
    StepRunner,
    sampled_tokens,
    with_generator_keys,
)
from asyncpaged.worker.step_sampling import sample_draws, verify_proposals

__all__ = [
    "AttentionChoice",
    "ModelRunner",
    "SampledToken",
    "SequenceStep",
    "StepPlan",
    "StepResult",
    "StepRunner",
    "WorkerSpec",
    "select_attention_backend",
]

_log = get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """How to build a runner (``ModelRunner.from_spec``): the engine's settings that it needs,
    as plain values, so one record builds the runner on the engine's worker thread, in the
    runner's own process and on every tensor-parallel rank (each builds its shard from it).

    ``model`` is the checkpoint's directory; ``dtype`` and ``kv_cache_dtype`` are torch dtype
    names ("float32"); ``device_type`` is "cpu" or "cuda" (the device itself is given beside
    the spec: a CUDA rank uses its local rank's device); ``num_threads`` sets the torch
    intra-op threads of a runner in a process of its own (rank 0's at start).
    """

    model: str
    dtype: str
    kv_cache_dtype: str
    num_device_blocks: int
    num_host_blocks: int
    block_size: int
    device_type: str
    attention_backend: AttentionChoice
    packed_linears: bool
    seed: int
    num_threads: int
    fused_elementwise: bool = True
    screened_lm_head: bool = True  # rank 0 samples
    int8_lm_head: bool = True
    native_bf16_decode: bool = True
    # decode batch sizes the runner captures at load, for max_model_len tokens (tensor-parallel
    # ranks capture together once every rank is ready: ``CaptureGraphs``)
    cuda_graph_sizes: tuple[int, ...] = ()
    max_model_len: int = 0
    quantized_activations: str = "float32"  # quantized weights: EngineConfig.quantized_activations
    # LoRA (EngineConfig.enable_lora): device slots, the largest rank, the host LRU's size
    max_loras: int = 0
    max_lora_rank: int = 0
    max_cpu_loras: int = 0


class ModelRunner:
    """One model (one tensor-parallel shard of it) running scheduled steps: its
    :class:`ModelInstance` (weights, device and host KV caches, decode graphs; ``model``,
    ``kv_cache``, ``host_kv_cache`` and ``graphs`` read through to it), the LM-head screens,
    the sampler's generator, the swap stream, an attached draft model, and what it keeps
    between steps (block tables, penalty histories, sampling options, the last tokens).

    Invariants: ``execute`` never reads a slot outside the plan's block tables; a swap copies
    the draft's blocks too; the instance's invariants hold (``worker/instance.py``).
    """

    def __init__(
        self,
        checkpoint_path: str | Path,
        dtype: str | torch.dtype = "auto",
        num_blocks: int = 1024,
        block_size: int = 16,
        num_host_blocks: int = 0,
        *,
        device: str | torch.device = "cpu",
        attn_backend: AttentionBackend | None = None,
        kv_fill_value: float | None = None,
        seed: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
        packed_linears: bool = True,
        screened_lm_head: bool = True,
        int8_lm_head: bool = True,
        fused_elementwise: bool = True,
        native_bf16_decode: bool = True,
        shard: TensorShard = SINGLE_SHARD,
        quantized_activations: str = "float32",
        max_loras: int = 0,
        max_lora_rank: int = 0,
        max_cpu_loras: int = 0,
    ) -> None:
        """Load the checkpoint and allocate caches; ``kv_fill_value`` poisons them (tests: NaN).

        ``seed`` seeds the generator of random rows without a per-request seed.
        ``kv_cache_dtype`` (None: the model's dtype) is the dtype K/V are stored in. The exact
        CPU levers: ``packed_linears`` pre-packs the layers' and the unscreened head's
        weights for oneDNN (float32 and bfloat16 models: ``packed_linear``); the rest apply to
        float32 models only: ``screened_lm_head`` picks greedy and top-k
        tokens through a bf16 screen (``lm_head``) when every row of a step qualifies
        (``sampler.is_screenable``, no logprob asked): the full head's tokens;
        ``int8_lm_head`` screens all-greedy steps with an int8 GEMM (``lm_head_int8``, the same
        tokens; where this CPU lacks exact int8 sums, the bf16 screen or the full head), with
        or without the bf16 screen (``asyncpaged.model.cpu_plan`` decides both per CPU);
        ``fused_elementwise`` gives the model native fused norm / RoPE / SiLU ops
        (``CausalLM.fused_ops``; used by the Llama family, not bit-identical: FMA and the norm's
        sum order) when the kernel library builds here. ``native_bf16_decode`` sends a bfloat16
        model's decodes to the native paged kernel (fp32 math) instead of torch's bf16 SDPA per
        sequence (transformers' bits; ``CpuAttentionBackend.sdpa_bf16_decode``). ``shard``
        picks a
        tensor-parallel shard of the weights and KV heads (a rank other than 0 never samples, so
        it builds no screened head). ``quantized_activations`` ("int8"): quantized weights
        multiply int8-quantized activations (``EngineConfig.quantized_activations``).
        ``max_loras`` > 0: LoRA slots of up to ``max_lora_rank`` (``model/lora_layers.py``), with
        a host LRU of ``max_cpu_loras`` adapters; each step's ``lora_loads`` fill them before its
        forward.
        """
        if num_blocks <= 0 or block_size <= 0 or num_host_blocks < 0:
            raise ValueError(
                "num_blocks and block_size must be > 0 and num_host_blocks >= 0, got "
                f"{num_blocks}, {block_size}, {num_host_blocks}."
            )
        self.instance = ModelInstance(
            checkpoint_path, dtype, torch.device(device), num_blocks=num_blocks,
            block_size=block_size, num_host_blocks=num_host_blocks, kv_cache_dtype=kv_cache_dtype,
            attn_backend=attn_backend, kv_fill_value=kv_fill_value, packed_linears=packed_linears,
            fused_elementwise=fused_elementwise, shard=shard,
            quantized_activations=quantized_activations,
        )  # fmt: skip
        self.device = self.instance.device
        self.dtype = self.instance.dtype
        self.kv_cache_dtype = self.instance.kv_cache_dtype
        self.block_size = block_size
        model = self.model
        if hasattr(model.attn_backend, "sdpa_bf16_decode"):  # CpuAttentionBackend
            model.attn_backend.sdpa_bf16_decode = not native_bf16_decode
        on_cpu = self.device.type == "cpu"
        cpu_fp32 = on_cpu and self.dtype == torch.float32
        if on_cpu and self.dtype == torch.bfloat16:  # greedy rows skip widening the logits
            from asyncpaged.kernels.cpu_argmax import native_argmax

            model.native_argmax = native_argmax()  # None: the torch path
        # The screens rank raw logits; a final softcap's float32 tanh can merge distinct logits
        # into ties (broken by index), so a softcapped model always takes the full head.
        # (A head kept quantized has no float matrix to screen or pack: it multiplies as it is.)
        float_head = model.quantized_head is None
        screenable = (cpu_fp32 and shard.rank == 0 and model.final_logit_softcap is None
                      and float_head)  # fmt: skip
        # ScreenedLMHead is the bf16 screen and the fp32 rescorer the int8 screen uses too.
        self.bf16_screen = screenable and screened_lm_head
        wants_head = self.bf16_screen or (screenable and int8_lm_head)
        self.screened_head = ScreenedLMHead(model.lm_head_weight()) if wants_head else None
        if packed_linears and on_cpu and shard.rank == 0 and not self.bf16_screen and float_head:
            # The full head then runs on every sampling step: oneDNN's packed layout, like the
            # layers (float32 with the screen off: +18% on an AVX2-capped Zen 4, +26% natively;
            # a bfloat16 head, never screened: 2x on AMX).
            model.packed_lm_head = pack_weight(model.lm_head_weight(), 64)
        self.int8_head: Int8ScreenedArgmax | None = None
        limit = int8_activation_limit() if self.screened_head is not None and int8_lm_head else None
        if self.screened_head is not None and limit is not None:
            try:
                self.int8_head = Int8ScreenedArgmax(
                    self.screened_head.weight, rescorer=self.screened_head, activation_limit=limit
                )
            except ValueError as exc:  # hidden size or weights outside its proof
                _log.info("int8_lm_head_unavailable", error=str(exc))
        on_cuda = self.device.type == "cuda"
        # Swaps on CUDA: pinned host blocks, non-blocking copies on a side stream.
        self._swap_stream = (
            torch.cuda.Stream(self.device) if on_cuda else None  # type: ignore[no-untyped-call]
        )
        self._step_end: torch.cuda.Event | None = None  # see _record_step_end
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # What the runner keeps of the last step's sequences: tables, options, histories
        self._batch = InputBatch()
        self._last_sampled: tuple[SampledToken, ...] = ()  # what the last step sampled
        # Where the sampling inputs of a step's late rows come from (``late_inputs``); a
        # runner in its own process reads them from its pipe instead
        self.late_inputs: LateSource = LateInputs()
        # Draft-model speculation (``attach_draft``): its cache mirrors this one's block ids.
        self.draft: DraftModel | None = None
        self.lora: LoRAWeights | None = None
        if max_loras:
            self.lora = LoRAWeights(model, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                    max_cpu_loras=max_cpu_loras or max_loras)  # fmt: skip

    @property
    def model(self) -> CausalLM:
        """The loaded model (this shard of it)."""
        return self.instance.model

    @property
    def kv_cache(self) -> PagedKVCache:
        """The device KV cache."""
        return self.instance.kv_cache

    @property
    def host_kv_cache(self) -> PagedKVCache:
        """The host (swap) KV cache."""
        return self.instance.host_kv_cache

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode forward's CUDA graphs (``capture_cuda_graphs``); None: none captured."""
        return self.instance.graphs

    @classmethod
    def from_spec(
        cls,
        spec: WorkerSpec,
        device: str | torch.device,
        *,
        attn_backend: AttentionBackend | None = None,
        shard: TensorShard = SINGLE_SHARD,
    ) -> ModelRunner:
        """The runner ``spec`` describes, on ``device`` (``shard``: a tensor-parallel rank's
        shard of it). ``attn_backend`` None: the one ``spec.attention_backend`` selects for
        ``device`` (blocking: the C++ kernel may compile)."""
        if attn_backend is None:
            attn_backend = select_attention_backend(str(device), spec.attention_backend)
        return cls(
            spec.model, getattr(torch, spec.dtype), spec.num_device_blocks, spec.block_size,
            spec.num_host_blocks, device=device, attn_backend=attn_backend, seed=spec.seed,
            kv_cache_dtype=getattr(torch, spec.kv_cache_dtype), packed_linears=spec.packed_linears,
            screened_lm_head=spec.screened_lm_head, int8_lm_head=spec.int8_lm_head,
            fused_elementwise=spec.fused_elementwise, native_bf16_decode=spec.native_bf16_decode,
            shard=shard, quantized_activations=spec.quantized_activations,
            max_loras=spec.max_loras, max_lora_rank=spec.max_lora_rank,
            max_cpu_loras=spec.max_cpu_loras,
        )  # fmt: skip

    @torch.inference_mode()
    def capture_cuda_graphs(
        self, sizes: Sequence[int], max_model_len: int, capture: Capture | None = None
    ) -> tuple[int, ...]:
        """Capture the decode forward for these batch sizes (``cuda_graphs``), the draft
        model's too when one is attached; the sizes captured for the target, () where graphs
        cannot run here (logged with the reason). ``capture`` replaces the CUDA capture (tests:
        an eager stand-in on the CPU)."""
        captured = self.instance.capture_graphs(sizes, max_model_len, capture)
        if self.draft is not None:
            self.draft.capture_cuda_graphs(sizes, max_model_len, capture)
        return captured

    def load_draft(self, spec: DraftSpec) -> None:
        """Load the draft model (its own KV cache over this runner's block ids) and speculate
        with it (blocking: a worker thread, or the runner's process)."""
        draft = DraftModel.from_spec(spec, self.device)
        self.attach_draft(draft, spec.max_model_len)
        _log.info("draft_model_loaded", model=spec.model, num_layers=draft.model.num_layers,
                 num_scratch_blocks=draft.num_scratch_blocks)  # fmt: skip

    def attach_draft(self, draft: DraftModel, max_model_len: int | None = None) -> None:
        """Speculate with ``draft``: it runs every step's batch and proposes (``draft.py``)."""
        vocab_size = self.model.vocab_rows()
        draft.check_target(vocab_size, self.kv_cache.num_blocks, self.block_size, max_model_len)
        self.draft = draft

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy (device block, host block) pairs to the host cache (on CUDA, after the device
        has finished the last step that returned); the draft's blocks too."""
        self.instance.swap_out(pairs, self._swap_stream, self._step_end)
        if self.draft is not None:
            self.draft.swap_out(pairs, self._swap_stream, self._step_end)

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy (host block, device block) pairs back to the device cache (and the draft's)."""
        self.instance.swap_in(pairs, self._swap_stream, self._step_end)
        if self.draft is not None:
            self.draft.swap_in(pairs, self._swap_stream, self._step_end)

    def _record_step_end(self) -> None:
        """CUDA: mark the end of a step's device work; swaps issued after the step returned
        wait for it (the step may still run on the device)."""
        if self._swap_stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self._step_end = event

    def _inputs(
        self, plan: StepPlan, rows: ResolvedRows
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """The step's attention metadata, token ids [T] and positions [T]; ``rows``: the
        plan's rows resolved against the runner's input batch."""
        seqs = plan.seqs
        n = len(seqs)
        num_blocks = rows.num_blocks
        qlens = np.fromiter(map(len, (s.token_ids for s in seqs)), np.int64, n)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        num_slots = np.fromiter(map(len, (s.slot_mapping for s in seqs)), np.int64, n)
        context = starts + qlens
        bad = (qlens <= 0) | (num_slots != qlens) | (num_blocks * self.block_size < context)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            self._refuse(seqs[first], int(num_blocks[first]))
        decodes = int(qlens.max()) == 1
        if decodes:  # all decodes: one token each
            ids = np.fromiter((s.token_ids[0] for s in seqs), np.int64, n)
            slots = np.fromiter((s.slot_mapping[0] for s in seqs), np.int64, n)
            positions = starts
        else:
            ids = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), np.int64)
            slots = np.fromiter(chain.from_iterable(s.slot_mapping for s in seqs), np.int64)
            # position of row j of sequence i: starts[i] + j
            offsets = np.arange(int(qlens.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(qlens) - qlens, qlens
            )
            positions = np.repeat(starts, qlens) + offsets
        if int(ids.min()) < 0:
            self._fill_late(ids, seqs, None if decodes else np.cumsum(qlens))
        rope_lens = None  # the context lengths themselves
        if any(s.min_rope_len for s in seqs):
            rope_lens = np.maximum(context, [s.min_rope_len for s in seqs])
        metadata = AttentionMetadata.build(
            query_lens=qlens,
            context_lens=context,
            block_tables=rows.tables,
            slot_mapping=slots,
            device=self.device,
            block_size=self.block_size,
            rope_lens=rope_lens,
        )
        input_tensor = torch.from_numpy(ids).to(self.device)
        position_tensor = torch.from_numpy(positions).to(self.device)
        return metadata, input_tensor, position_tensor

    def placeholder_values(self) -> dict[int, int]:
        """The token the last step sampled, by sequence (a row's late input or history; under
        tensor parallelism rank 0 puts them into the other ranks' rows)."""
        return {t.seq_id: t.token_id for t in self._last_sampled}

    def _fill_late(
        self, ids: np.ndarray, seqs: tuple[SequenceStep, ...], ends: np.ndarray | None
    ) -> None:
        """Async scheduling: a row planned before the last step returned has a placeholder
        (``PLACEHOLDER_TOKEN``) for input, the token the last step sampled for its sequence.
        ``ends``: each sequence's end in ``ids`` (None: one token each)."""
        positions = np.flatnonzero(ids == PLACEHOLDER_TOKEN)
        rows = positions if ends is None else np.searchsorted(ends, positions, side="right")
        last = self.placeholder_values()
        for pos, row in zip(positions.tolist(), rows.tolist(), strict=True):
            seq_id = seqs[row].seq_id
            assert seq_id in last, f"sequence {seq_id}: a placeholder, but no token sampled last"
            ids[pos] = last[seq_id]

    def put_late_inputs(self, delivery: LateDelivery) -> None:
        """From the event loop: the late sampling inputs of a step this runner's thread runs
        or will run."""
        assert isinstance(self.late_inputs, LateInputs), "a runner in its process reads its pipe"
        self.late_inputs.put(delivery)

    def _refuse(self, seq: SequenceStep, num_blocks: int) -> None:
        """A malformed sequence step (a scheduler bug): fail loudly, naming what is wrong."""
        num_new = len(seq.token_ids)
        assert num_new > 0, f"sequence {seq.seq_id} has no new tokens"
        assert len(seq.slot_mapping) == num_new, (
            f"sequence {seq.seq_id}: {len(seq.slot_mapping)} slots for {num_new} tokens"
        )
        context = seq.num_computed_tokens + num_new
        raise AssertionError(
            f"sequence {seq.seq_id}: {num_blocks} blocks cannot hold {context} tokens"
        )

    @torch.inference_mode()
    def execute_forward(self, plan: StepPlan) -> None:
        """A tensor-parallel rank other than 0: copy-on-write and the forward (its all-reduces
        pair with rank 0's ``execute`` of the same plan); no LM head, no sampling."""
        self.instance.copy_blocks(plan.copy_pairs)
        if plan.seqs:
            rows = self._batch.update(plan.seqs, self.placeholder_values)
            metadata, input_tensor, position_tensor = self._inputs(plan, rows)
            self.instance.forward(input_tensor, position_tensor, metadata)
        self._record_step_end()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: copy-on-write, forward over the flat batch, sampling."""
        try:
            return self._execute(plan)
        finally:
            self._record_step_end()

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        self.instance.copy_blocks(plan.copy_pairs)
        draft = self.draft
        if draft is not None:
            draft.copy_blocks(plan.copy_pairs)
        if not plan.seqs:
            return StepResult(sampled=())
        rows = self._batch.update(plan.seqs, self.placeholder_values)
        seqs = rows.seqs
        plan = with_generator_keys(plan if seqs is plan.seqs else replace(plan, seqs=seqs))
        inputs = self._inputs(plan, rows)
        lora = self.lora
        if lora is None:
            result, seqs = self._target_step(plan, *inputs, seen=rows.seen)
        else:  # the target runs with each row's adapter; the draft without
            for load in plan.lora_loads:
                lora.load(load.slot, load.path, load.digest)
            seqs_in = plan.seqs
            qlens = np.fromiter(map(len, (s.token_ids for s in seqs_in)), np.int64, len(seqs_in))
            row_slots = np.fromiter((s.lora_slot for s in seqs_in), np.int64, len(seqs_in))
            lora.begin_step(np.repeat(row_slots, qlens), self.device)
            try:
                result, seqs = self._target_step(plan, *inputs, seen=rows.seen)
            finally:
                lora.end_step()
        if self.instance.graphed:
            result = replace(result, cuda_graph=True)
        if draft is not None:  # (its proposals drawn with the late options too)
            result = draft.step(plan if seqs is plan.seqs else replace(plan, seqs=seqs),
                                inputs, result)  # fmt: skip
        self._last_sampled = result.sampled  # the inputs of the next step's placeholders
        return result

    def _target_step(
        self,
        plan: StepPlan,
        metadata: AttentionMetadata,
        input_tensor: torch.Tensor,
        position_tensor: torch.Tensor,
        seen: dict[int, SeenTokens] | None = None,
    ) -> tuple[StepResult, tuple[SequenceStep, ...]]:
        """The target's forward, prompt logprobs, verification and sampling; ``seen``: the
        penalty histories the runner keeps, by sequence. Also the rows as sampled: with
        their late inputs put in (async scheduling)."""
        began = time.perf_counter()
        hidden = self.instance.forward(input_tensor, position_tensor, metadata)  # [T, H]
        prompt = (
            compute_prompt_logprobs(self.model, hidden, plan.seqs, metadata.query_start_loc_host)
            if any(s.prompt_targets for s in plan.seqs)
            else ()
        )
        seqs = (
            plan.seqs
            if not plan.late_rows
            else with_late_inputs(plan.seqs, self.late_inputs.take(plan.late_rows))
        )
        sampling = [i for i, s in enumerate(seqs) if s.do_sample]
        verified: tuple[SampledToken, ...] = ()
        if any(s.num_draft for s in seqs):
            sampling = [i for i in sampling if not seqs[i].num_draft]
            verified = verify_proposals(
                self.model, plan.seqs, hidden, metadata.query_start_loc_host,
                head=self.screened_head, int8_head=self.int8_head, bf16_screen=self.bf16_screen,
                draft=self.draft, generator=self.generator,
            )  # fmt: skip
        if not sampling:
            compute_s = time.perf_counter() - began
            return StepResult(sampled=verified, compute_s=compute_s, prompt_logprobs=prompt), seqs
        draws = [
            (seqs[i], k, opt)
            for i in sampling
            for k, opt in enumerate(seqs[i].parallel_options or (seqs[i].sampling,))
        ]
        # Unless every sequence is a decode (one row each) sampled once: its last row per draw.
        if not len(draws) == len(sampling) == len(seqs) == hidden.shape[0]:
            ends = metadata.query_start_loc_host
            rows = [
                ends[i + 1] - 1 for i in sampling for _ in range(len(seqs[i].parallel_options) or 1)
            ]
            hidden = hidden[torch.tensor(rows, device=self.device)]
        out = sample_draws(
            self.model, draws, hidden,
            head=self.screened_head, int8_head=self.int8_head, bf16_screen=self.bf16_screen,
            generator=self.generator, seen=seen,
        )  # fmt: skip
        compute_s = time.perf_counter() - began
        sampled = sampled_tokens(draws, out) + verified
        return StepResult(sampled=sampled, compute_s=compute_s, prompt_logprobs=prompt), seqs
