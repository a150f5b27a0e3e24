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

``sample_from_candidates`` gives the same tokens from the top-k candidates of the bf16-screened
LM head (``lm_head.TopKCandidates``) for the rows ``is_screenable`` admits, without the fp32 GEMM
over the whole vocabulary: it reads the same random stream and sums over full-width rows that
hold -inf wherever ``sample`` has -inf after top-k.

Here: the options, the seeded generators' keys, ``sample`` and every random draw (the full rows'
and the candidates'). ``sampler_stages`` holds the stages before the draw (``process_logits``,
``apply_logit_controls``, ``random_probs``) and ``sampler_candidates`` which rows may be screened
(``is_screenable``, ``screened_top_k``) and their probabilities at the candidates; their names
are re-exported from this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asyncpaged.model.lm_head import TopKCandidates
from asyncpaged.model.logits_processors import argmax_rows
from asyncpaged.model.penalty_histories import SeenTokens
from asyncpaged.model.sampler_candidates import (
    MAX_SCREENED_TOP_K,
    _candidate_probs,
    is_screenable,
    screened_top_k,
)
from asyncpaged.model.sampler_stages import (
    _process,
    _random_probs,
    apply_logit_controls,
    process_logits,
    random_probs,
)

__all__ = [
    "MAX_SCREENED_TOP_K",
    "SAMPLING_EPS",
    "SamplerOutput",
    "SamplingOptions",
    "apply_logit_controls",
    "derive_generator_key",
    "exponential_race",
    "greedy",
    "is_screenable",
    "process_logits",
    "random_probs",
    "salt_generator_key",
    "sample",
    "sample_from_candidates",
    "screened_top_k",
]

SAMPLING_EPS = 1e-5
"""Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``)."""

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingOptions:
    """One sequence's sampling options for one step (numbers only; the engine fills them in).

    ``top_k`` 0 = off; ``num_logprobs`` = top logprobs to return besides the sampled token
    (``None``: none, and no sampled-token logprob unless the step asks for it). The engine sets
    ``min_tokens_mask_ids`` (EOS + stop token ids) only while fewer than ``min_tokens`` tokens
    were generated. ``prompt_token_ids`` / ``output_token_ids`` feed the penalties; with
    ``history_seq`` set the runner keeps that sequence's penalty history between steps
    (``penalty_histories``) and ``output_token_ids`` holds only the output tokens after the
    first ``history_start``, which it already has.
    ``generator_key`` seeds this row's generator when ``seed`` is set (see
    ``derive_generator_key``); it is ignored otherwise. Logit controls (vLLM's): only
    ``allowed_token_ids`` keep their logits (None: all), ``logit_bias`` (token id, bias) pairs
    are added, ``banned_token_ids`` (the bad words' next tokens this step) get -inf; all before
    the penalties, none in the raw logprobs.
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
    history_seq: int | None = None
    history_start: int = 0
    generator_key: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    banned_token_ids: tuple[int, ...] = ()
    token_bitmask: torch.Tensor | None = None  # [ceil(V / 32)] int32: structured outputs
    # The request's own processors, (output_token_ids, logits [V]) -> logits [V], after the rest
    logits_processors: tuple[Callable[[list[int], torch.Tensor], torch.Tensor], ...] = ()

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
    def has_logit_controls(self) -> bool:
        """Whether logit_bias, allowed_token_ids, banned tokens or a grammar's bitmask move this
        row's logits."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids is not None
            or self.banned_token_ids
            or self.token_bitmask is not None
            or bool(self.logits_processors)
        )

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


def salt_generator_key(generator_key: int, salt: int) -> int:
    """A 63-bit generator seed derived from ``generator_key`` for another use of the same draw
    position (for example speculative decoding's acceptance test), independent of the stream
    ``generator_key`` itself seeds."""
    return _splitmix64((generator_key ^ _splitmix64(salt & _MASK64)) & _MASK64) >> 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerOutput:
    """Chosen tokens and, when asked, raw logprobs (``log_softmax`` of the unprocessed logits)."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32, logprob of the chosen token; None if unasked
    ranks: torch.Tensor | None  # [N] int64, 1-based: number of tokens with logprob >= chosen
    top_token_ids: torch.Tensor | None  # [N, K] int64, K = max num_logprobs, best first
    top_logprobs: torch.Tensor | None  # [N, K] float32
    # row -> what its logits processor raised (the row's token is then meaningless)
    errors: Mapping[int, BaseException] = field(default_factory=dict)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32 -> [N] int64 argmax; ties go to the lowest token id."""
    return argmax_rows(logits)


def sample(
    logits: torch.Tensor,
    options: Sequence[SamplingOptions | None] | None = None,
    *,
    want_logprobs: bool = False,
    generator: torch.Generator | None = None,
    penalty_seen: Sequence[SeenTokens | None] | None = None,
) -> SamplerOutput:
    """Sample one token per row of ``logits`` [N, V] float32; ``options[i] is None`` = greedy.

    Logprobs (and ranks) are computed for every row when ``want_logprobs`` or any row sets
    ``num_logprobs``; the top ``max(num_logprobs)`` ids/logprobs when that max is > 0.
    ``generator`` draws for random rows without a seed (torch's default generator if None).
    ``penalty_seen[i]``: row ``i``'s penalty history as the runner keeps it (its options set
    ``history_seq``), instead of its token lists.
    """
    assert logits.dtype == torch.float32, f"sampler expects float32 logits, got {logits.dtype}"
    num_rows = logits.shape[0]
    opts: Sequence[SamplingOptions | None] = options if options is not None else [None] * num_rows
    assert len(opts) == num_rows, f"{len(opts)} sampling options for {num_rows} rows"
    num_top = max((o.num_logprobs or 0 for o in opts if o is not None), default=0)
    want_logprobs = want_logprobs or any(o is not None and o.num_logprobs is not None for o in opts)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # [N, V]
    errors: dict[int, BaseException] = {}
    processed = _process(logits, opts, errors, penalty_seen)  # [N, V]: masks, penalties
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
            token_ids=token_ids, logprobs=None, ranks=None, top_token_ids=None,
            top_logprobs=None, errors=errors,
        )  # fmt: skip
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
        errors=errors,
    )


def _sample_random(
    logits: torch.Tensor, opts: Sequence[SamplingOptions], generator: torch.Generator | None
) -> torch.Tensor:
    """Rows that sample (temperature >= eps): logits [R, V] -> [R] int64 token ids."""
    probs = _random_probs(logits, opts)  # [R, V]
    return exponential_race(probs, opts, generator)


def exponential_race(
    probs: torch.Tensor, opts: Sequence[SamplingOptions], generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (rows sum to 1), drawn as ``sample`` draws the
    random rows of these options: seeded rows read their ``generator_key``'s stream, the others
    ``generator``'s. Speculative decoding uses it to draw exactly the token ``sample`` would."""
    # Exponential race: argmax(p / q) with q ~ Exp(1) picks token v with probability p[v].
    q = _exponential_draws(opts, probs.shape[1], probs.device, generator)
    q.clamp_min_(torch.finfo(torch.float32).tiny)  # never divide by zero
    return argmax_rows(probs / q)


def _exponential_draws(
    opts: Sequence[SamplingOptions],
    vocab_size: int,
    device: torch.device,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """q [R, V] float32 ~ Exp(1): one draw of all unseeded rows from ``generator``, then each
    seeded row from a fresh generator seeded with its ``generator_key``.

    On CPU the same numbers come from the float64 uniform stream, row by row, as
    ``-log1p(-u)`` (what ``exponential_`` computes there, checked once per process by
    ``_exponential_is_uniform_transform``): about twice as fast as ``exponential_`` itself.
    """
    q = torch.empty(len(opts), vocab_size, dtype=torch.float32, device=device)
    if device.type == "cpu" and _exponential_is_uniform_transform():
        row = torch.empty(vocab_size, dtype=torch.float64)
        for r, row_generator in _uniform_stream_rows(opts, generator):
            row.uniform_(generator=row_generator).neg_()
            torch.log1p(row, out=row)
            q[r] = row.neg_()  # -log1p(-u), rounded to float32 by the copy
        return q
    unseeded = [r for r, o in enumerate(opts) if o.seed is None]
    if unseeded:
        draws = torch.empty(len(unseeded), vocab_size, device=device)
        draws.exponential_(generator=generator)
        q[torch.tensor(unseeded, dtype=torch.int64, device=device)] = draws
    for r, o in enumerate(opts):
        if o.seed is not None:
            row_generator = torch.Generator(device=device).manual_seed(o.generator_key)
            q[r] = torch.empty(vocab_size, device=device).exponential_(generator=row_generator)
    return q


# ---- sampling from the screened LM head's top-k candidates ---------------------------------------


def sample_from_candidates(
    candidates: TopKCandidates,
    options: Sequence[SamplingOptions | None] | None = None,
    *,
    generator: torch.Generator | None = None,
) -> SamplerOutput | None:
    """``sample(L, options, generator=generator)`` from the top-k candidates of ``L``'s rows.

    ``L`` is any fp32 logits matrix that equals ``candidates.logits`` on the candidates (other
    entries: any fp32 evaluation of the LM head). For screenable rows (``is_screenable``) the
    tokens are bit for bit those of ``sample(L, ...)`` and ``generator`` ends in the same state:

    - the tokens ``sample`` keeps after top-k are all candidates, and each other token's logit,
      scaled by the temperature, is checked to stay below the k-th largest scaled candidate;
    - every value that reaches the tokens is computed by the same torch operation on the same
      values: elementwise ones (temperature, masks, ``p / q``) on the candidates alone, the
      order-dependent sums (softmax, top-p's cumulative sum) on full-vocabulary rows that hold
      the candidates' values and -inf where ``sample`` has -inf after top-k, in its positions;
    - the random draws are those of ``sample`` (the whole stream, read at the candidates);
    - argmax over ascending candidate ids keeps the lowest id among ties, as over the full row.

    Returns None, having drawn nothing, when that check fails (temperature scaling that
    overflows or rounds a non-candidate onto the k-th largest): sample the full logits instead.
    Never returns logprobs (``is_screenable`` excludes rows that want them).
    """
    ids, logits = candidates.token_ids, candidates.logits  # [N, C]
    num_rows, vocab_size = ids.shape[0], candidates.vocab_size
    opts: Sequence[SamplingOptions | None] = options if options is not None else [None] * num_rows
    assert len(opts) == num_rows, f"{len(opts)} sampling options for {num_rows} rows"
    assert all(is_screenable(o, vocab_size) for o in opts), "a row is not screenable"
    assert all(k <= candidates.top_k[r] for r, k in enumerate(screened_top_k(opts))), (
        "candidates screened for a smaller top-k than the options ask for"
    )
    if num_rows == 0:
        token_ids = torch.empty(0, dtype=torch.int64, device=ids.device)
        return SamplerOutput(
            token_ids=token_ids, logprobs=None, ranks=None, top_token_ids=None, top_logprobs=None
        )
    token_ids = ids.gather(1, argmax_rows(logits)[:, None])[:, 0]  # greedy rows
    random_rows = [i for i, o in enumerate(opts) if o is not None and not o.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.int64, device=ids.device)
        chosen = [o for o in opts if o is not None and not o.is_greedy]
        picked = _sample_candidates(
            ids[rows], logits[rows], candidates.outside_bound[rows], chosen, vocab_size, generator
        )
        if picked is None:
            return None
        token_ids[rows] = picked
    return SamplerOutput(
        token_ids=token_ids, logprobs=None, ranks=None, top_token_ids=None, top_logprobs=None
    )


def _sample_candidates(
    ids: torch.Tensor,
    logits: torch.Tensor,
    outside_bound: torch.Tensor,
    opts: Sequence[SamplingOptions],
    vocab_size: int,
    generator: torch.Generator | None,
) -> torch.Tensor | None:
    """``_sample_random`` on candidates ids/logits [R, C] -> [R] int64, or None."""
    probs = _candidate_probs(ids, logits, outside_bound, opts, vocab_size)  # [R, C]
    if probs is None:
        return None
    is_pad = ids == vocab_size
    q = _candidate_draws(ids.masked_fill(is_pad, 0), opts, vocab_size, generator)
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    ratio = (probs / q).masked_fill_(is_pad, -1.0)
    best = argmax_rows(ratio)[:, None]  # first maximum: the lowest id
    token_ids = ids.gather(1, best)[:, 0]
    # Outside tokens race with p / q == 0 exactly; if no candidate beats 0, argmax is token 0.
    return torch.where(ratio.gather(1, best)[:, 0] > 0, token_ids, 0)


def _candidate_draws(
    ids: torch.Tensor,
    opts: Sequence[SamplingOptions],
    vocab_size: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``_exponential_draws(...)`` at ``ids`` [R, C] only, advancing the generators alike.

    On CPU, ``exponential_`` turns each float64 ``uniform_`` draw ``u`` of the same stream into
    ``-log1p(-u)``: the uniforms are drawn row by row into one cached row (the stream is
    sequential) and the logarithm is only taken at the candidates, 4-8x cheaper. Checked once
    per process (``_exponential_is_uniform_transform``); otherwise the full draws are made and
    read at the candidates.
    """
    device = ids.device
    if device.type != "cpu" or not _exponential_is_uniform_transform():
        return _exponential_draws(opts, vocab_size, device, generator).gather(1, ids)
    uniforms = torch.empty(ids.shape, dtype=torch.float64, device=device)  # [R, C]
    row = torch.empty(vocab_size, dtype=torch.float64, device=device)
    for r, row_generator in _uniform_stream_rows(opts, generator):
        torch.index_select(row.uniform_(generator=row_generator), 0, ids[r], out=uniforms[r])
    return _exponential_from_uniform(uniforms)


def _uniform_stream_rows(
    opts: Sequence[SamplingOptions], generator: torch.Generator | None
) -> list[tuple[int, torch.Generator | None]]:
    """(row, generator) in the order ``_exponential_draws`` consumes the streams (CPU): the
    unseeded rows from ``generator`` first (its one [R', V] draw), then each seeded row from a
    fresh generator seeded with its ``generator_key``."""
    rows: list[tuple[int, torch.Generator | None]] = [
        (r, generator) for r, o in enumerate(opts) if o.seed is None
    ]
    rows += [
        (r, torch.Generator().manual_seed(o.generator_key))
        for r, o in enumerate(opts)
        if o.seed is not None
    ]
    return rows


def _exponential_from_uniform(uniforms: torch.Tensor) -> torch.Tensor:
    return (-torch.log1p(-uniforms)).float()


@functools.cache
def _exponential_is_uniform_transform() -> bool:
    """Whether this torch's CPU ``exponential_`` (default dtype) is ``-log1p(-u)`` of the
    float64 ``uniform_`` stream, draw for draw, with a 2-D draw equal to one draw per row and
    the generator left in the same state."""
    ok = True
    for seed, (num_rows, width) in ((20240601, (1, 4096)), (7, (3, 1531))):
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.empty(num_rows, width).exponential_(generator=a)
        got = torch.stack(
            [
                _exponential_from_uniform(
                    torch.empty(width, dtype=torch.float64).uniform_(generator=b)
                )
                for _ in range(num_rows)
            ]
        )
        ok = ok and want.dtype == torch.float32 and torch.equal(want, got)
        ok = ok and torch.equal(a.get_state(), b.get_state())
    return ok
