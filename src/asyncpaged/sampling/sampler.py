"""Token selection from float32 logits, with vLLM v1's sampling semantics.

Per row, in order (vLLM v1 ``Sampler.forward``)::

    raw logits ─┬─> log_softmax ──> logprobs of the sampled token, its rank, the top-n (if asked)
                └─> min-tokens mask (-inf on EOS/stop ids) ─> repetition penalty
                    ─> frequency / presence penalties ─┬─> greedy row: argmax (ties: lowest id)
                                                       └─> random row: / temperature ─> min-p
                                                           ─> top-k ─> top-p ─> softmax
                                                           ─> inverse transform draw, u ~ U[0, 1)

min-p comes before top-k/top-p as in vLLM v1 (it is an argmax-invariant logits processor there;
vLLM v0 applied it last). A random row draws one uniform ``u`` and takes the first token whose
cumulative weight exceeds ``u`` times the total (:func:`draw_tokens`; the weights are the
probabilities as exact integers, so any summation order gives the same token). A row with a
seed takes ``u`` from its ``generator_key`` alone, so its token never depends on the other rows
of the batch or their order; rows without a seed share the caller's generator.

``sample_from_candidates`` gives the same tokens from the top-k candidates of the bf16-screened
LM head (``lm_head.TopKCandidates``) for the rows ``is_screenable`` admits, without the fp32 GEMM
over the whole vocabulary: it sums over full-width rows that hold -inf wherever ``sample`` has
-inf after top-k, and draws with the same ``u``.

Here: the options, the seeded generators' keys, ``sample`` and every random draw (the full rows'
and the candidates'). ``stages`` holds the stages before the draw (``process_logits``,
``apply_logit_controls``, ``random_probs``) and ``candidates`` which rows may be screened
(``is_screenable``, ``screened_top_k``) and their probabilities at the candidates; their names
are re-exported from this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from asyncpaged.kernels.cpu_argmax import argmax_rows
from asyncpaged.model.lm_head import TopKCandidates
from asyncpaged.sampling.candidates import (
    MAX_SCREENED_TOP_K,
    _candidate_probs,
    is_screenable,
    screened_top_k,
)
from asyncpaged.sampling.options import (
    MASK64,
    SamplingOptions,
    SeenTokens,
    splitmix64,
)
from asyncpaged.sampling.stages import (
    _process,
    _random_probs,
    apply_logit_controls,
    process_logits,
    random_probs,
    record_ruled_out,
)

__all__ = [
    "MAX_SCREENED_TOP_K",
    "SamplerOutput",
    "apply_logit_controls",
    "draw_tokens",
    "greedy",
    "is_screenable",
    "process_logits",
    "random_probs",
    "row_uniforms",
    "sample",
    "sample_from_candidates",
    "screened_top_k",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerOutput:
    """Chosen tokens and, when asked, raw logprobs (``log_softmax`` of the unprocessed logits)."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float32, logprob of the chosen token; None if unasked
    ranks: torch.Tensor | None  # [N] int64, 1-based: number of tokens with logprob >= chosen
    top_token_ids: torch.Tensor | None  # [N, K] int64, K = max num_logprobs, best first
    top_logprobs: torch.Tensor | None  # [N, K] float32
    # row -> what its logits processor raised, or NoTokenAllowedError (the row's token is then
    # meaningless)
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
    elif len(random_rows) == num_rows:  # every row samples: no gather and scatter of [N, V]
        token_ids = _sample_random(processed, [o for o in opts if o is not None], generator)
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
    if processed is not logits:  # (unprocessed logits rule nothing out)
        record_ruled_out(processed.gather(1, token_ids[:, None])[:, 0], errors)
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
    return draw_tokens(probs, opts, generator)


_WEIGHT_SCALE = float(2**52)
"""A probability ``p`` weighs ``floor(p * 2**52)`` (exact: a float32 times a power of two)."""


def draw_tokens(
    probs: torch.Tensor, opts: Sequence[SamplingOptions], generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (rows sum to 1), drawn as ``sample`` draws the
    random rows of these options: each row's uniform (:func:`row_uniforms`) through the
    inverse of its cumulative weights (:func:`_inverse_cdf`). Speculative decoding uses it to
    draw exactly the token ``sample`` would."""
    return _inverse_cdf(probs, row_uniforms(opts, probs.device, generator))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, V] float32 >= 0, u [R] float64 in [0, 1) -> [R] int64: the first position
    whose cumulative weight exceeds ``u`` times the row's total weight.

    The weights are ``floor(p * 2**52)`` as int64, so the cumulative sums are exact and the
    same in any order, on any device, with zeros anywhere in between: position ``v`` is
    drawn with probability ``w[v] / sum(w)``, within 2**-52 of ``p[v]`` (a token below 2**-52
    is never drawn), and a row of candidates in ascending id order draws the token its full
    row draws. One pass and a cumulative sum instead of ``V`` random numbers per row."""
    cdf = (probs * _WEIGHT_SCALE).long().cumsum_(dim=-1)  # [R, V] exact integers
    total = cdf[:, -1:]  # [R, 1] > 0: a row's largest probability is at least 1 / V
    target = (u[:, None] * total.double()).long()
    target = torch.minimum(target, total - 1)  # (rounds up to total only past 2**53)
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]  # cdf[v] > target, first v
    return picked.clamp_max_(probs.shape[1] - 1)  # (only a NaN row could pass the end)


def row_uniforms(
    opts: Sequence[SamplingOptions], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """u [R] float64 in [0, 1): the unseeded rows one draw each from ``generator``, in row
    order; each seeded row the top 53 bits of a hash of its ``generator_key`` (so its draw
    depends on nothing else)."""
    u = [_uniform_of_key(o.generator_key) if o.seed is not None else -1.0 for o in opts]
    unseeded = [r for r, o in enumerate(opts) if o.seed is None]
    out = torch.tensor(u, dtype=torch.float64, device=device)
    if unseeded:  # drawn where the generator lives: no device-to-host copy
        draws = torch.rand(len(unseeded), dtype=torch.float64, device=device, generator=generator)
        out[torch.tensor(unseeded, dtype=torch.int64, device=device)] = draws
    return out


def _uniform_of_key(generator_key: int) -> float:
    return (splitmix64(generator_key & MASK64) >> 11) * 2.0**-53


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
      values: elementwise ones (temperature, masks) on the candidates alone, the
      order-dependent sums (softmax, top-p's cumulative sum) on full-vocabulary rows that hold
      the candidates' values and -inf where ``sample`` has -inf after top-k, in its positions;
    - the draw uses the same uniforms (one per row), and the cumulative integer weights over
      ascending candidate ids are the full row's at those ids (the other tokens weigh 0);
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
    # Ascending ids (padding: weight 0, last): the full row's cumulative weights at the
    # candidates, so the same uniform picks the same token.
    picked = _inverse_cdf(probs, row_uniforms(opts, ids.device, generator))
    return ids.gather(1, picked[:, None])[:, 0]
