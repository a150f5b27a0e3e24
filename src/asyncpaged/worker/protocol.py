"""One step's records, exchanged by the scheduler actor and the runner: the plan
(:class:`StepPlan` of :class:`SequenceStep` rows), the result (:class:`StepResult` of
:class:`~asyncpaged.sampled_token.SampledToken` rows, defined low so the scheduler core reads
them too), what drives a runner (:class:`StepRunner`), and the functions that
turn the sampler's tensors into result rows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from asyncpaged.sampled_token import SampledToken
from asyncpaged.sampling.options import SamplingOptions, derive_generator_key
from asyncpaged.sampling.sampler import SamplerOutput

__all__ = [
    "LateDelivery",
    "PromptLogprobRows",
    "SampledToken",
    "SequenceStep",
    "StepPlan",
    "StepResult",
    "StepRunner",
    "greedy_verdicts",
    "plain_greedy",
    "sampled_tokens",
    "with_generator_keys",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LateDelivery:
    """The late inputs of one step: ``rows`` is that step's ``StepPlan.late_rows``;
    ``options`` the sampling options of those rows whose options read the output ((seq id,
    options), None: plain greedy); ``masks[i]`` ([ceil(V / 32)] int32) is the grammar bitmask
    of ``masked[i]`` (one array for all: cheap to pickle)."""

    rows: tuple[int, ...]
    options: tuple[tuple[int, SamplingOptions | None], ...] = ()
    masked: tuple[int, ...] = ()
    masks: np.ndarray | None = None  # [len(masked), ceil(V / 32)] int32

    def masks_by_seq(self) -> dict[int, torch.Tensor]:
        """Each masked row's bitmask, by sequence id."""
        if not self.masked:
            return {}
        assert self.masks is not None
        return dict(zip(self.masked, torch.from_numpy(self.masks).unbind(0), strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptLogprobRows:
    """One sequence's prompt logprobs from one step: entry ``i`` is for the prompt token at
    position ``first_position + i`` given the tokens before it (its id, logprob and 1-based rank
    by logprob, ties counted in as vLLM does) and the top ``num_top`` (id, logprob), best first.
    """

    seq_id: int
    first_position: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


class LoRALoad(NamedTuple):
    """Put the adapter whose content digest is ``digest`` (a PEFT directory at ``path``, the
    engine's snapshot of those bytes) into LoRA slot ``slot``."""

    slot: int
    path: str
    digest: str


class SequenceStep(NamedTuple):
    """One sequence's share of a step (a named tuple: one per sequence per step).

    ``token_ids`` sit at positions ``num_computed_tokens ..``; after the step the cache holds
    ``num_computed_tokens + len(token_ids)`` tokens, which the block table must cover (the
    runner's stored table up to ``table_start``, then ``block_table``). ``do_sample``
    is False for a prefill chunk that stops short of the prompt's end (its logits are not needed).
    ``sampling`` None = greedy with no penalties. The sampled token's logprob and rank come back
    when ``want_logprob`` or ``sampling.num_logprobs`` is set. ``min_rope_len``: the RoPE
    scaling of length-dependent types (dynamic, longrope) is chosen for at least this sequence
    length (the scheduler sets it for a longrope request in its long regime).
    """

    seq_id: int
    token_ids: tuple[int, ...]
    num_computed_tokens: int
    slot_mapping: tuple[int, ...]  # one slot per new token; -1 = do not store
    # Physical block ids in logical order, from entry ``table_start`` of the table on: the
    # runner keeps the entries before it from the last step (``input_batch``).
    block_table: tuple[int, ...]
    do_sample: bool
    want_logprob: bool = False
    sampling: SamplingOptions | None = None
    # Parallel sampling: when not empty, the row is sampled once per entry (sample ``i`` with
    # ``parallel_options[i]``) instead of once with ``sampling``.
    parallel_options: tuple[SamplingOptions | None, ...] = ()
    min_rope_len: int = 0
    # Prompt logprobs (``prompt_logprobs``): the prompt tokens that rows ``prompt_row_offset ..``
    # of this step predict, and how many top tokens to return for each.
    prompt_targets: tuple[int, ...] = ()
    prompt_row_offset: int = 0
    num_prompt_logprobs: int = 0
    # Speculative decoding: the last ``num_draft`` tokens are proposals; the logits of the last
    # ``num_draft + 1`` rows verify them, row ``j`` with ``verify_options[j]`` (empty: plain
    # greedy), and the row's result holds the accepted proposals and the target's next token.
    num_draft: int = 0
    verify_options: tuple[SamplingOptions | None, ...] = ()
    # Draft-model speculation: proposals wanted for this sequence's next step (the runner's
    # draft proposes them after the token this step emits; ``SampledToken.proposals``).
    draft_k: int = 0
    # How many leading entries of the table the runner keeps from the last step, where this
    # sequence also ran (0: ``block_table`` is the whole table; see ``input_batch``).
    table_start: int = 0
    # ``sampling`` is None and the runner takes the options it holds for this sequence from
    # the last step (``input_batch``)
    keep_sampling: bool = False
    # A penalty history the runner keeps (``sampling.history_seq`` set): ``(start, tail,
    # late)``, the runner holds the first ``start`` output tokens, ``tail`` follows them, and
    # with ``late`` the token the last step sampled for the sequence after that (a row planned
    # ahead of it); see ``input_batch``
    history: tuple[int, tuple[int, ...], bool] | None = None
    # The LoRA slot whose adapter the sequence runs with (-1: the base model); the plan's
    # ``lora_loads`` put the adapter there before the forward.
    lora_slot: int = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """Everything the runner needs for one step; ``copy_pairs`` (src, dst) run first.
    ``late_rows``: the sequence ids of rows whose sampling inputs (a grammar's bitmask,
    options that read the output) come after the step started (``late_inputs``), in row
    order."""

    seqs: tuple[SequenceStep, ...]
    copy_pairs: tuple[tuple[int, int], ...] = ()
    late_rows: tuple[int, ...] = ()
    lora_loads: tuple[LoRALoad, ...] = ()  # adapters to put in their slots before the forward


def with_generator_keys(plan: StepPlan) -> StepPlan:
    """``plan`` with the generator key of every seeded draw whose options take it from the
    row's position (``SamplingOptions.key_from_position``) filled in: the draw after the row
    is the sequence's ``num_computed_tokens + len(token_ids) - prompt length``-th generated
    token's (the key ``derive_generator_key`` gives the scheduler for it). One pass; the plan
    itself when no row has such options."""
    seqs: list[SequenceStep] | None = None  # a copy of plan.seqs once a row changes
    for i, s in enumerate(plan.seqs):
        if s.sampling is None and not s.parallel_options:
            continue
        n = s.num_computed_tokens + len(s.token_ids)
        sampling = _keyed(s.sampling, n)
        parallel_options = tuple(_keyed(o, n) for o in s.parallel_options)
        if sampling is s.sampling and all(
            a is b for a, b in zip(parallel_options, s.parallel_options, strict=True)
        ):
            continue
        if seqs is None:
            seqs = list(plan.seqs)
        seqs[i] = s._replace(sampling=sampling, parallel_options=parallel_options)
    return plan if seqs is None else dataclasses.replace(plan, seqs=tuple(seqs))


def _keyed(options: SamplingOptions | None, num_context: int) -> SamplingOptions | None:
    """``options`` with the generator key of the draw after ``num_context`` tokens, where it
    takes the key from the position; else ``options`` itself."""
    if options is None or options.key_from_position is None:
        return options
    assert options.seed is not None, "a key from the position without a seed"
    index, num_prompt = options.key_from_position
    key = derive_generator_key(options.seed, index, num_context - num_prompt)
    return dataclasses.replace(options, generator_key=key, key_from_position=None)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """One entry per sequence with ``do_sample``, in plan order.

    ``compute_s``: seconds spent in the model forward, the LM head and sampling (the rest of
    ``execute`` is building inputs and results: the runner's overhead).
    """

    sampled: tuple[SampledToken, ...]
    compute_s: float = 0.0
    prompt_logprobs: tuple[PromptLogprobRows, ...] = ()  # for sequences with prompt_targets
    cuda_graph: bool = False  # the forward replayed a captured CUDA graph (``cuda_graphs``)


class StepRunner(Protocol):
    """What the executor and swap actors drive: a :class:`ModelRunner`, or, under tensor
    parallelism, ``asyncpaged.distributed.TensorParallelRunner`` (which also drives the other
    ranks)."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def put_late_inputs(self, delivery: LateDelivery) -> None: ...

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None: ...

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None: ...


def greedy_verdicts(
    spec: list[tuple[int, SequenceStep]], drafts: list[tuple[int, ...]], argmax: list[int]
) -> tuple[SampledToken, ...]:
    """Greedy verification: a sequence keeps its proposals while each equals the target's
    argmax before it, then takes the argmax at the first mismatch (or after the last)."""
    out = []
    row = 0
    for (_, seq), draft in zip(spec, drafts, strict=True):
        best = argmax[row : row + len(draft) + 1]
        kept = 0
        while kept < len(draft) and draft[kept] == best[kept]:
            kept += 1
        out.append(SampledToken(seq.seq_id, best[kept], None, None, (), 0, None, draft[:kept]))
        row += len(draft) + 1
    return tuple(out)


def plain_greedy(seq: SequenceStep, opt: SamplingOptions | None) -> bool:
    """A row whose token is the plain argmax of its logits, or of its logits under a grammar's
    bitmask (no logprobs, penalties, other masks or logit controls)."""
    if seq.want_logprob:
        return False
    return opt is None or (
        opt.is_greedy
        and not opt.has_penalties
        and not opt.min_tokens_mask_ids
        and not (
            opt.logit_bias
            or opt.allowed_token_ids is not None
            or opt.banned_token_ids
            or opt.logits_processors
        )
        and opt.num_logprobs is None
    )


def sampled_tokens(
    draws: list[tuple[SequenceStep, int, SamplingOptions | None]], out: SamplerOutput
) -> tuple[SampledToken, ...]:
    token_ids = out.token_ids.tolist()
    if out.logprobs is None and out.top_token_ids is None and not out.errors:
        new = tuple.__new__  # (the named tuple's constructor is a Python call per row)
        return tuple(
            new(SampledToken, (seq.seq_id, token, None, None, (), index, None, (), ()))
            for (seq, index, _), token in zip(draws, token_ids, strict=True)
        )
    logprobs = out.logprobs.tolist() if out.logprobs is not None else None
    ranks = out.ranks.tolist() if out.ranks is not None else None
    top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
    top_logprobs = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    sampled = []
    for k, (seq, index, opt) in enumerate(draws):
        logprob, rank = None, None
        wants = seq.want_logprob or (opt is not None and opt.num_logprobs is not None)
        if wants and logprobs is not None and ranks is not None:
            logprob, rank = float(logprobs[k]), int(ranks[k])
        num_top = opt.num_logprobs if opt is not None else None
        top: tuple[tuple[int, float], ...] = ()
        if num_top and top_ids is not None and top_logprobs is not None:
            top = tuple(zip(top_ids[k][:num_top], top_logprobs[k][:num_top], strict=True))
        sampled.append(
            SampledToken(
                seq_id=seq.seq_id,
                token_id=int(token_ids[k]),
                logprob=logprob,
                rank=rank,
                top_logprobs=top,
                sample_index=index,
                error=out.errors.get(k),
            )
        )
    return tuple(sampled)
