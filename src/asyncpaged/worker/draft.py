"""Speculative decoding's draft model: a smaller checkpoint that proposes the next tokens.

The draft shares the target's tokenizer and vocabulary and keeps **its own paged KV cache over
the same block ids** (same ``num_blocks`` and ``block_size``, its own layers and heads), so the
block pool's decisions (appends, prefix-cache hits, copy-on-write, forks, swaps, truncation of
rejected proposals) hold for both caches alike:

* every step the draft runs a forward over the step's whole flat batch (the target's token ids,
  positions, slots and block tables): its cache holds every token the target's holds;
* copy-on-write pairs and swaps are applied to both caches (same block ids; the draft has a host
  cache as large as the target's);
* at the end of the step, each sampling sequence of a speculating request (``draft_k > 0``)
  gets up to ``draft_k`` proposals for its next step: ``draft_k`` autoregressive draft decodes
  from its newly emitted token, batched over sequences. Their K/V must not land in real slots
  (not allocated yet): the sequence's partial last block is copied into a *scratch* block (ids
  ``>= num_blocks``, only the draft cache has them), the decodes attend over the real blocks up
  to the kept length with scratch blocks in place of the last one, and write there (discarded).

Proposals are drawn with the request's sampling options at the emitted position (logits
processors dropped): greedy rows take the argmax, random rows draw from the draft's processed
distribution ``q`` (``sampler.process_logits`` then ``random_probs``), seeded rows from a salted
stream of their generator key. ``q`` is kept per sequence for the next step's verification
(``rejection.verify``'s ``draft_probs``); a sequence whose ``q`` is missing is verified as a
one-hot proposal, which is exact too (any proposal independent of the verification's draws is).

:class:`~asyncpaged.actors.draft_proposals.DraftProposals` is the scheduler side: the
step's proposals, handed to the core's ``propose(seq_id, token_ids, k)`` when the sequence's
context still ends where the draft began.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from asyncpaged._log import get_logger
from asyncpaged.errors import InvalidRequestError
from asyncpaged.model.attention import AttentionBackend, AttentionMetadata
from asyncpaged.model.attention_select import AttentionChoice, select_attention_backend
from asyncpaged.model.base import CausalLM
from asyncpaged.model.kv_cache import PagedKVCache
from asyncpaged.model.packed_linear import pack_weight
from asyncpaged.sampling.options import SamplingOptions, salt_generator_key
from asyncpaged.sampling.sampler import draw_tokens, greedy, process_logits, random_probs
from asyncpaged.worker.cuda_graphs import Capture, DecodeGraphs
from asyncpaged.worker.instance import ModelInstance

if TYPE_CHECKING:
    from asyncpaged.worker.protocol import SampledToken, SequenceStep, StepPlan, StepResult

log = get_logger(__name__)

DRAFT_SALT = 0x5EC_D2AF7
"""Salt of the generator key for a seeded row's draft draw ``j`` (``DRAFT_SALT + j``)."""


class _Root(NamedTuple):
    """A sequence the draft proposes for: its emitted ``token`` sits at position ``length``
    (the tokens kept in the cache before it), ``k`` proposals wanted."""

    row: int  # into the step's sampled tokens
    seq: SequenceStep
    token: int
    length: int
    k: int
    options: SamplingOptions | None
    table: np.ndarray  # its block table: its row of the step's padded tables


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftSpec:
    """How to load a draft model beside a runner: plain values, so the runner's own process
    (``executor_backend="process"``) can load it as the engine's process does. Dtypes are
    torch dtype names ("float32"); ``path`` is the draft checkpoint's resolved directory."""

    path: str
    model: str  # as the user named it (logs)
    dtype: str
    kv_cache_dtype: str
    num_blocks: int
    num_host_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    num_speculative_tokens: int
    attention_backend: AttentionChoice
    packed_linears: bool
    fused_elementwise: bool
    seed: int


class DraftModel:
    """The draft checkpoint, its device KV cache (+ scratch blocks) and host (swap) cache: a
    :class:`ModelInstance` (``model``, ``kv_cache``, ``host_kv_cache`` and ``graphs`` read
    through to it), and the proposals' generator and ``q`` rows.

    Invariants: ``kv_cache`` has ``num_blocks + num_scratch_blocks`` blocks of ``block_size``;
    block ids ``< num_blocks`` mirror the target's blocks; scratch ids are written only by
    proposal decodes and never read past one ``propose``. ``_draft_probs`` holds the ``q`` rows
    of the last step's random proposals only.
    """

    def __init__(
        self,
        checkpoint_path: str | Path,
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        max_num_seqs: int,
        num_speculative_tokens: int,
        kv_cache_dtype: torch.dtype | None = None,
        attn_backend: AttentionBackend | None = None,
        kv_fill_value: float | None = None,
        packed_linears: bool = True,
        fused_elementwise: bool = True,
        seed: int = 0,
    ) -> None:
        """Load the draft on ``device`` in ``dtype``; scratch blocks for ``max_num_seqs``
        sequences proposing ``num_speculative_tokens`` each. ``attn_backend`` must be the
        draft's own instance (backends keep per-step plans)."""
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_k = num_speculative_tokens
        self.num_scratch_blocks = max_num_seqs * (num_speculative_tokens // block_size + 2)
        self.instance = ModelInstance(
            checkpoint_path, dtype, self.device, num_blocks=num_blocks + self.num_scratch_blocks,
            block_size=block_size, num_host_blocks=num_host_blocks, kv_cache_dtype=kv_cache_dtype,
            attn_backend=attn_backend, kv_fill_value=kv_fill_value, packed_linears=packed_linears,
            fused_elementwise=fused_elementwise,
        )  # fmt: skip
        model = self.model
        float_head = model.quantized_head is None
        if self.device.type == "cpu" and packed_linears and float_head:  # runs every proposal
            model.packed_lm_head = pack_weight(model.lm_head_weight(), 64)
        self.vocab_size = model.vocab_rows()
        # Positions past it are never fed to the draft (learned position embeddings end there)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.generator = torch.Generator(device=self.device).manual_seed(seed ^ DRAFT_SALT)
        self._draft_probs: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    @classmethod
    def from_spec(cls, spec: DraftSpec, device: torch.device) -> DraftModel:
        """The draft ``spec`` describes, on ``device``, with an attention backend of its own
        (``spec.attention_backend``; blocking)."""
        return cls(
            spec.path, dtype=getattr(torch, spec.dtype), device=device,
            num_blocks=spec.num_blocks, block_size=spec.block_size,
            num_host_blocks=spec.num_host_blocks, max_num_seqs=spec.max_num_seqs,
            num_speculative_tokens=spec.num_speculative_tokens,
            kv_cache_dtype=getattr(torch, spec.kv_cache_dtype),
            attn_backend=select_attention_backend(str(device), spec.attention_backend),
            packed_linears=spec.packed_linears, fused_elementwise=spec.fused_elementwise,
            seed=spec.seed,
        )  # fmt: skip

    @property
    def model(self) -> CausalLM:
        """The draft's loaded model."""
        return self.instance.model

    @property
    def kv_cache(self) -> PagedKVCache:
        """The draft's device KV cache (the target's block ids, then the scratch blocks)."""
        return self.instance.kv_cache

    @property
    def host_kv_cache(self) -> PagedKVCache:
        """The draft's host (swap) KV cache."""
        return self.instance.host_kv_cache

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The draft's decode graphs (``capture_cuda_graphs``); None: none captured."""
        return self.instance.graphs

    def capture_cuda_graphs(
        self, sizes: Sequence[int], max_model_len: int, capture: Capture | None = None
    ) -> tuple[int, ...]:
        """Capture the draft's decode forward for these batch sizes (``cuda_graphs``): its
        proposal decodes, and its pass over a decode-only step, replay them. Their tables
        reach ``num_speculative_tokens`` positions past ``max_model_len`` (scratch blocks)."""
        return self.instance.capture_graphs(
            sizes, max_model_len + self.max_k, capture, name="draft"
        )

    def check_target(
        self, vocab_size: int, num_blocks: int, block_size: int, max_model_len: int | None = None
    ) -> None:
        """Refuse a draft whose vocabulary or block layout differs from the target's, or that
        cannot run the target's longest sequences (``max_model_len``)."""
        if max_model_len is not None and self.max_positions < max_model_len:
            raise InvalidRequestError(
                f"the draft model handles {self.max_positions} positions, fewer than "
                f"max_model_len ({max_model_len}); set max_model_len <= {self.max_positions}."
            )
        if self.vocab_size != vocab_size:
            raise InvalidRequestError(
                f"the draft model's vocabulary ({self.vocab_size} tokens) differs from the "
                f"target's ({vocab_size}); a draft must share the target's tokenizer."
            )
        assert (self.num_blocks, self.block_size) == (num_blocks, block_size), (
            "the draft cache must mirror the target's blocks"
        )

    # ---- mirrored cache operations ----------------------------------------------------------

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.instance.copy_blocks(pairs)

    def swap_out(
        self,
        pairs: tuple[tuple[int, int], ...],
        stream: torch.cuda.Stream | None,
        after: torch.cuda.Event | None,
    ) -> None:
        self.instance.swap_out(pairs, stream, after)

    def swap_in(
        self,
        pairs: tuple[tuple[int, int], ...],
        stream: torch.cuda.Stream | None,
        after: torch.cuda.Event | None,
    ) -> None:
        self.instance.swap_in(pairs, stream, after)

    # ---- a step -----------------------------------------------------------------------------

    def step(
        self,
        plan: StepPlan,
        inputs: tuple[AttentionMetadata, torch.Tensor, torch.Tensor],
        result: StepResult,
    ) -> StepResult:
        """After the target's part of a step: the draft's forward over the same batch, then
        the proposals for the next step (in ``SampledToken.proposals``)."""
        began = time.perf_counter()
        metadata, input_tensor, position_tensor = inputs
        self.instance.forward(input_tensor, position_tensor, metadata)
        sampled = self.propose(plan, result.sampled, metadata.block_tables_host)
        compute_s = result.compute_s + time.perf_counter() - began
        return dataclasses.replace(result, sampled=sampled, compute_s=compute_s)

    def draft_probs(self, spec: Sequence[SequenceStep]) -> torch.Tensor | None:
        """``verify``'s ``draft_probs`` for these speculative sequences: the ``q`` rows their
        proposals were drawn from, one-hot rows where none was kept (greedy rows, a sequence
        that skipped a step); None when no sequence has ``q`` rows."""
        rows: list[torch.Tensor] = []
        found = False
        for s in spec:
            draft = s.token_ids[len(s.token_ids) - s.num_draft :]
            kept = self._draft_probs.get(s.seq_id)
            if kept is not None and kept[0][: s.num_draft] == draft:
                rows.append(kept[1][: s.num_draft])
                found = True
            else:
                one_hot = torch.zeros(len(draft), self.vocab_size, device=self.device)
                ids = torch.tensor(draft, dtype=torch.int64, device=self.device)
                one_hot[torch.arange(len(draft), device=self.device), ids] = 1.0
                rows.append(one_hot)
        return torch.cat(rows) if found and rows else None

    def propose(
        self, plan: StepPlan, sampled: tuple[SampledToken, ...], block_tables: np.ndarray
    ) -> tuple[SampledToken, ...]:
        """Up to ``draft_k`` proposals after each sampling sequence's emitted token: the
        draft decodes batched over sequences, K/V written into scratch blocks.
        ``block_tables``: the step's tables, one row per sequence of ``plan``."""
        roots = _roots(plan, sampled, self.max_positions, block_tables)
        self._draft_probs = {}
        if not roots:
            return sampled
        tables, slots = self._scratch_layout(roots)
        roots = roots[: len(tables)]
        if not roots:
            return sampled
        tokens = [[r.token] for r in roots]
        q_rows: list[list[torch.Tensor]] = [[] for _ in roots]
        for j in range(max(r.k for r in roots)):
            live = [i for i, r in enumerate(roots) if r.k > j]
            logits = self._decode(roots, live, tables, slots, tokens, j)
            options = [_draft_options(roots[i].options, j) for i in live]
            drawn, probs = _draw(logits, options, self.generator)
            for row, i in enumerate(live):
                tokens[i].append(drawn[row])
                if row in probs:
                    q_rows[i].append(probs[row])
        out = list(sampled)
        for i, root in enumerate(roots):
            proposals = tuple(tokens[i][1:])
            out[root.row] = out[root.row]._replace(proposals=proposals)
            if q_rows[i]:
                self._draft_probs[root.seq.seq_id] = (proposals, torch.stack(q_rows[i]))
        return tuple(out)

    def _scratch_layout(self, roots: list[_Root]) -> tuple[list[tuple[int, ...]], list[list[int]]]:
        """Per root: the block table of its proposal decodes (real blocks up to the kept
        length, then scratch blocks; a partial last block is copied into the first scratch
        block) and the scratch slot of each decode ``j``."""
        bs = self.block_size
        next_scratch = self.num_blocks
        pairs: list[tuple[int, int]] = []
        tables: list[tuple[int, ...]] = []
        slots: list[list[int]] = []
        for r in roots:
            first, last = r.length // bs, (r.length + r.k - 1) // bs
            scratch = list(range(next_scratch, next_scratch + last - first + 1))
            next_scratch += len(scratch)
            if next_scratch > self.kv_cache.num_blocks:  # more sequences than sized for
                break  # the rest propose nothing this step
            if r.length % bs:
                pairs.append((int(r.table[first]), scratch[0]))
            tables.append((*r.table[:first].tolist(), *scratch))
            slots.append(
                [scratch[p // bs - first] * bs + p % bs for p in range(r.length, r.length + r.k)]
            )
        self.copy_blocks(pairs)
        return tables, slots

    def _decode(
        self,
        roots: list[_Root],
        live: list[int],
        tables: list[tuple[int, ...]],
        slots: list[list[int]],
        tokens: list[list[int]],
        j: int,
    ) -> torch.Tensor:
        """Draft decode ``j`` of the ``live`` roots: their last token at position
        ``length + j`` -> float32 logits [len(live), V]."""
        lengths = [roots[i].length + j for i in live]
        contexts = [n + 1 for n in lengths]
        rope = [max(c, roots[i].seq.min_rope_len) for c, i in zip(contexts, live, strict=True)]
        metadata = AttentionMetadata.build(
            query_lens=[1] * len(live),
            context_lens=contexts,
            block_tables=[tables[i] for i in live],
            slot_mapping=[slots[i][j] for i in live],
            device=self.device,
            block_size=self.block_size,
            rope_lens=rope if any(roots[i].seq.min_rope_len for i in live) else None,
        )
        ids = torch.tensor([tokens[i][-1] for i in live], dtype=torch.int64, device=self.device)
        positions = torch.tensor(lengths, dtype=torch.int64, device=self.device)
        hidden = self.instance.forward(ids, positions, metadata)
        return self.model.compute_logits(hidden)  # (before the next replay)


def _roots(
    plan: StepPlan, sampled: tuple[SampledToken, ...], max_positions: int, tables: np.ndarray
) -> list[_Root]:
    """The sampling sequences that want proposals, each from its emitted token (its draft
    decodes stay below ``max_positions``)."""
    wanting = {
        s.seq_id: (i, s)
        for i, s in enumerate(plan.seqs)
        if s.draft_k and s.do_sample and not s.parallel_options
    }
    roots = []
    for index, t in enumerate(sampled):
        found = wanting.get(t.seq_id)
        if found is None or t.error is not None or t.sample_index:
            continue
        plan_index, s = found
        accepted = len(t.accepted)
        length = s.num_computed_tokens + len(s.token_ids) - s.num_draft + accepted
        if s.num_draft:
            options = s.verify_options[accepted] if s.verify_options else None
        else:
            options = s.sampling
        k = min(s.draft_k, max_positions - length)
        if k > 0:
            roots.append(_Root(index, s, t.token_id, length, k, options, tables[plan_index]))
    return roots


def _draft_options(options: SamplingOptions | None, j: int) -> SamplingOptions | None:
    """A proposal's options: the emitted position's, without logits processors (a request's
    own code never runs on draft logits), seeded rows on a stream salted for draw ``j``."""
    if options is None:
        return None
    return dataclasses.replace(
        options,
        num_logprobs=None,
        logits_processors=(),
        generator_key=salt_generator_key(options.generator_key, DRAFT_SALT + j),
    )


def _draw(
    logits: torch.Tensor, options: list[SamplingOptions | None], generator: torch.Generator
) -> tuple[list[int], dict[int, torch.Tensor]]:
    """One proposal per row: greedy rows the argmax of their processed logits, random rows a
    draw from ``q``; returns the tokens and ``{row: q row}`` for the random rows."""
    if all(o is None for o in options):
        return greedy(logits).tolist(), {}
    processed = process_logits(logits, options, {})
    tokens = greedy(processed)
    random = [i for i, o in enumerate(options) if o is not None and not o.is_greedy]
    if not random:
        return tokens.tolist(), {}
    random_opts = [o for o in options if o is not None and not o.is_greedy]
    index = torch.tensor(random, dtype=torch.int64, device=logits.device)
    probs = random_probs(processed[index], random_opts)
    tokens[index] = draw_tokens(probs, random_opts, generator)
    return tokens.tolist(), dict(zip(random, probs.unbind(0), strict=True))
