"""Token selection from float32 logits, with vLLM v1's sampling semantics.

Per row, in order (vLLM v1 ``Sampler.forward``)::

    raw logits ─┬─> log_softmax ──> logprobs of the sampled token, its rank, the top-n (if asked)
                └─> min-tokens mask (-inf on EOS/stop ids) ─> repetition penalty
                    ─> frequency / presence penalties ─┬─> greedy row: argmax (ties: lowest id)
                                                       └─> random row: / temperature ─> min-p
                                                           ─> top-k ─> top-p ─> softmax
                                                           ─> argmax(probs / q), q ~ Exp(1)

min-p comes before top-k/top-p as in vLLM v1 (it is an argmax-invariant logits processor there;
vLLM v0 applied it last). ``q`` of a row with a seed is drawn from a ``torch.Generator`` seeded with
the row's ``generator_key`` alone, so its token never depends on the other rows of the batch or
their order; rows without a seed share the caller's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncpaged.model.logits_processors import (
    apply_min_p,
    apply_min_tokens_mask,
    apply_penalties,
    apply_top_k_top_p,
)

SAMPLING_EPS = 1e-5
"""Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``)."""

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingOptions:
    """One sequence's sampling options for one step (numbers only; the engine fills them in).

    ``top_k`` 0 = off; ``num_logprobs`` = top logprobs to return besides the sampled token
    (``None``: none, and no sampled-token logprob unless the step asks for it). The engine sets
    ``min_tokens_mask_ids`` (EOS + stop token ids) only while fewer than ``min_tokens`` tokens
    were generated. ``prompt_token_ids`` / ``output_token_ids`` feed the penalties.
    ``generator_key`` seeds this row's generator when ``seed`` is set (see
    ``derive_generator_key``); it is ignored otherwise.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int | None = None
    min_tokens_mask_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    generator_key: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.num_logprobs is not None and self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be non-negative, got {self.num_logprobs}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_generator_key(seed: int, seq_index: int, num_generated_tokens: int) -> int:
    """A 63-bit generator seed for one draw: a pure function of the request's seed, the
    sequence's index within the request (``n > 1``) and how many tokens it has generated.

    Being a function of these alone (no generator state carried between steps), a seeded
    sequence draws the same tokens however it is batched and after preemption by recompute.
    """
    key = _splitmix64(seed & _MASK64)
    key = _splitmix64(key ^ (seq_index & _MASK64))
    key = _splitmix64(key ^ (num_generated_tokens & _MASK64))
    return key >> 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerOutput:
    """Chosen tokens and, when asked, raw logprobs (``log_softmax`` of the unprocessed logits)."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32, logprob of the chosen token; None if unasked
    ranks: torch.Tensor | None  # [N] int64, 1-based: number of tokens with logprob >= chosen
    top_token_ids: torch.Tensor | None  # [N, K] int64, K = max num_logprobs, best first
    top_logprobs: torch.Tensor | None  # [N, K] float32


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32 -> [N] int64 argmax; ties go to the lowest token id."""
    # torch.argmax returns the first maximal index, i.e. the lowest id among ties.
    return torch.argmax(logits, dim=-1)


def sample(
    logits: torch.Tensor,
    options: Sequence[SamplingOptions | None] | None = None,
    *,
    want_logprobs: bool = False,
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Sample one token per row of ``logits`` [N, V] float32; ``options[i] is None`` = greedy.

    Logprobs (and ranks) are computed for every row when ``want_logprobs`` or any row sets
    ``num_logprobs``; the top ``max(num_logprobs)`` ids/logprobs when that max is > 0.
    ``generator`` draws for random rows without a seed (torch's default generator if None).
    """
    assert logits.dtype == torch.float32, f"sampler expects float32 logits, got {logits.dtype}"
    num_rows = logits.shape[0]
    opts: Sequence[SamplingOptions | None] = options if options is not None else [None] * num_rows
    assert len(opts) == num_rows, f"{len(opts)} sampling options for {num_rows} rows"
    num_top = max((o.num_logprobs or 0 for o in opts if o is not None), default=0)
    want_logprobs = want_logprobs or any(o is not None and o.num_logprobs is not None for o in opts)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # [N, V]
    processed = _process(logits, opts)  # [N, V]: masks and penalties applied
    random_rows = [i for i, o in enumerate(opts) if o is not None and not o.is_greedy]
    if not random_rows:
        token_ids = greedy(processed)
    else:
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        is_random = set(random_rows)
        greedy_rows = [i for i in range(num_rows) if i not in is_random]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, dtype=torch.int64, device=logits.device)
            token_ids[rows] = greedy(processed[rows])
        rows = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
        chosen = [o for o in opts if o is not None and not o.is_greedy]
        token_ids[rows] = _sample_random(processed[rows], chosen, generator)
    if raw_logprobs is None:
        return SamplerOutput(
            token_ids=token_ids, logprobs=None, ranks=None, top_token_ids=None, top_logprobs=None
        )
    chosen_logprobs = raw_logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (raw_logprobs >= chosen_logprobs).sum(dim=-1)  # [N]
    top_logprobs, top_ids = (None, None)
    if num_top > 0:
        top_logprobs, top_ids = raw_logprobs.topk(min(num_top, logits.shape[1]), dim=-1)
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=chosen_logprobs[:, 0],
        ranks=ranks,
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def _process(logits: torch.Tensor, opts: Sequence[SamplingOptions | None]) -> torch.Tensor:
    """Min-tokens masking and penalties (they change greedy rows too); ``logits`` is not edited."""
    masked = [i for i, o in enumerate(opts) if o is not None and o.min_tokens_mask_ids]
    penalized = [i for i, o in enumerate(opts) if o is not None and o.has_penalties]
    if not masked and not penalized:
        return logits
    logits = logits.clone()
    apply_min_tokens_mask(logits, [o.min_tokens_mask_ids if o is not None else () for o in opts])
    if penalized:
        rows = torch.tensor(penalized, dtype=torch.int64, device=logits.device)
        subset = [o for o in opts if o is not None and o.has_penalties]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=logits.device)

        logits[rows] = apply_penalties(
            logits[rows],
            prompt_token_ids=[o.prompt_token_ids for o in subset],
            output_token_ids=[o.output_token_ids for o in subset],
            repetition_penalties=column([o.repetition_penalty for o in subset]),
            frequency_penalties=column([o.frequency_penalty for o in subset]),
            presence_penalties=column([o.presence_penalty for o in subset]),
        )
    return logits


def _sample_random(
    logits: torch.Tensor, opts: Sequence[SamplingOptions], generator: torch.Generator | None
) -> torch.Tensor:
    """Rows that sample (temperature >= eps): logits [R, V] -> [R] int64 token ids."""
    device, vocab_size = logits.device, logits.shape[1]
    temperature = torch.tensor([o.temperature for o in opts], dtype=torch.float32, device=device)
    logits = logits / temperature[:, None]
    if any(o.min_p > 0.0 for o in opts):
        min_p = torch.tensor([o.min_p for o in opts], dtype=torch.float32, device=device)
        logits = apply_min_p(logits, min_p)
    top_k = None
    if any(0 < o.top_k < vocab_size for o in opts):
        ks = [o.top_k if 0 < o.top_k < vocab_size else vocab_size for o in opts]
        top_k = torch.tensor(ks, dtype=torch.int64, device=device)
    top_p = None
    if any(o.top_p < 1.0 for o in opts):
        top_p = torch.tensor([o.top_p for o in opts], dtype=torch.float32, device=device)
    logits = apply_top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    # Exponential race: argmax(p / q) with q ~ Exp(1) picks token v with probability p[v].
    q = torch.empty_like(probs)
    unseeded = [r for r, o in enumerate(opts) if o.seed is None]
    if unseeded:
        draws = torch.empty(len(unseeded), vocab_size, device=device)
        draws.exponential_(generator=generator)
        q[torch.tensor(unseeded, dtype=torch.int64, device=device)] = draws
    for r, o in enumerate(opts):
        if o.seed is not None:
            row_generator = torch.Generator(device=device).manual_seed(o.generator_key)
            q[r] = torch.empty(vocab_size, device=device).exponential_(generator=row_generator)
    q.clamp_min_(torch.finfo(torch.float32).tiny)  # never divide by zero
    return torch.argmax(probs / q, dim=-1)
