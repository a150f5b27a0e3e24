"""A step's LM head and sampling, after the forward: the runner's ``_target_step`` calls
``sample_draws`` for its sampling rows and ``verify_proposals`` for its speculative sequences.

Each takes the cheapest head that gives the full head's tokens: the int8 screen
(``lm_head_int8``) for plain greedy rows, else the bf16 screen (``lm_head``), which also draws
greedy and top-k rows from its candidates (``sampler.sample_from_candidates``); a bfloat16
model's plain greedy rows without a grammar take the native argmax of its bf16 logits
(``CausalLM.head_argmax``); otherwise the full head (``CausalLM.compute_logits``, float32
logits) and ``sampler.sample`` or, for sampled proposals, ``rejection.verify``.
The runner builds the screens (``ModelRunner.screened_head``, ``int8_head``, ``bf16_screen``)
and passes them in, with its generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncpaged.sampling.options import SamplingOptions
from asyncpaged.sampling.rejection import verify
from asyncpaged.sampling.sampler import (
    SamplerOutput,
    greedy,
    is_screenable,
    sample,
    sample_from_candidates,
    screened_top_k,
)
from asyncpaged.structured_outputs import grammar_mask_bias
from asyncpaged.worker.protocol import SampledToken, SequenceStep, greedy_verdicts, plain_greedy

if TYPE_CHECKING:
    from asyncpaged.model.base import CausalLM
    from asyncpaged.model.lm_head import ScreenedLMHead
    from asyncpaged.model.lm_head_int8 import Int8ScreenedArgmax
    from asyncpaged.sampling.options import SeenTokens
    from asyncpaged.worker.draft import DraftModel


def sample_draws(
    model: CausalLM,
    draws: list[tuple[SequenceStep, int, SamplingOptions | None]],
    hidden: torch.Tensor,
    *,
    head: ScreenedLMHead | None,
    int8_head: Int8ScreenedArgmax | None,
    bf16_screen: bool,
    generator: torch.Generator,
    seen: dict[int, SeenTokens] | None,
) -> SamplerOutput:
    """One token per draw from its row of ``hidden``: through a screen where every draw
    qualifies, else the full head; ``seen``: the penalty histories the runner keeps, by
    sequence."""
    token_ids = _screened_argmax(draws, hidden, head, int8_head, bf16_screen)
    if token_ids is not None:
        return SamplerOutput(
            token_ids=token_ids, logprobs=None, ranks=None, top_token_ids=None, top_logprobs=None
        )
    screened = _sample_screened(draws, hidden, head, bf16_screen, generator)
    if screened is not None:
        return screened
    if all(plain_greedy(s, o) and (o is None or o.token_bitmask is None) for s, _, o in draws):
        token_ids = model.head_argmax(hidden)
        if token_ids is not None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, ranks=None,
                                 top_token_ids=None, top_logprobs=None)  # fmt: skip
    logits = model.compute_logits(hidden)
    return sample(
        logits,
        [opt for _, _, opt in draws],
        want_logprobs=any(s.want_logprob for s, _, _ in draws),
        generator=generator,
        penalty_seen=[
            None if opt is None or opt.history_seq is None else seen[s.seq_id]
            for s, _, opt in draws
        ]
        if seen
        else None,
    )


def verify_proposals(
    model: CausalLM,
    seqs: tuple[SequenceStep, ...],
    hidden: torch.Tensor,
    ends: tuple[int, ...],
    *,
    head: ScreenedLMHead | None,
    int8_head: Int8ScreenedArgmax | None,
    bf16_screen: bool,
    draft: DraftModel | None,
    generator: torch.Generator,
) -> tuple[SampledToken, ...]:
    """Speculative decoding: score each sequence's proposals (its last ``num_draft + 1``
    rows; sequence ``i`` ends at row ``ends[i + 1]``) and keep what
    ``rejection.verify`` accepts. Plain greedy sequences take the target's argmax
    per row (through a screen, or a bfloat16 model's native argmax, where one applies)."""
    spec = [(i, s) for i, s in enumerate(seqs) if s.num_draft]
    rows = [r for i, s in spec for r in range(ends[i + 1] - 1 - s.num_draft, ends[i + 1])]
    states = hidden[torch.tensor(rows, device=hidden.device)]
    drafts = [s.token_ids[-s.num_draft :] for _, s in spec]
    if all(not s.verify_options for _, s in spec):
        plain: list[tuple[SequenceStep, int, SamplingOptions | None]] = [
            (s, 0, None) for _, s in spec for _ in range(s.num_draft + 1)
        ]
        argmax = _screened_argmax(plain, states, head, int8_head, bf16_screen)
        if argmax is None:
            argmax = model.head_argmax(states)
        if argmax is None:
            argmax = greedy(model.compute_logits(states))
        return greedy_verdicts(spec, drafts, argmax.tolist())
    options = [o for _, s in spec for o in s.verify_options or (None,) * (s.num_draft + 1)]
    draft_probs = None if draft is None else draft.draft_probs([s for _, s in spec])
    out = verify(model.compute_logits(states), drafts, options,
                 draft_probs=draft_probs, generator=generator)  # fmt: skip
    return tuple(
        SampledToken(s.seq_id, tokens[-1], None, None, (), 0, out.errors.get(k), tokens[:-1])
        for k, ((_, s), tokens) in enumerate(zip(spec, out.token_ids, strict=True))
    )


def _screened_argmax(
    draws: list[tuple[SequenceStep, int, SamplingOptions | None]],
    hidden: torch.Tensor,
    head: ScreenedLMHead | None,
    int8_head: Int8ScreenedArgmax | None,
    bf16_screen: bool,
) -> torch.Tensor | None:
    """The full head's greedy tokens through the int8 screen, else the bf16 one, when every
    row is plain greedy, a grammar's bitmask allowed (the screens then rank the allowed
    tokens only); None: neither applies (or both gave up on NaN/inf hidden states)."""
    if head is None or not all(plain_greedy(s, o) for s, _, o in draws):
        return None
    bitmasks = [None if o is None else o.token_bitmask for _, _, o in draws]
    bias = grammar_mask_bias(bitmasks, head.vocab_size, hidden.device)
    token_ids = int8_head.argmax(hidden, bias) if int8_head is not None else None
    if token_ids is None and bf16_screen:
        token_ids = head.argmax(hidden, bias)
    return token_ids


def _sample_screened(
    draws: list[tuple[SequenceStep, int, SamplingOptions | None]],
    hidden: torch.Tensor,
    head: ScreenedLMHead | None,
    bf16_screen: bool,
    generator: torch.Generator,
) -> SamplerOutput | None:
    """Greedy and top-k rows from the bf16 screen's candidates, the same tokens as
    ``sample`` on the full logits; None (nothing drawn yet): use the full head."""
    if (
        head is None
        or not bf16_screen
        or not all(
            not seq.want_logprob and is_screenable(opt, head.vocab_size) for seq, _, opt in draws
        )
    ):
        return None
    opts = [opt for _, _, opt in draws]
    candidates = head.topk_candidates(hidden, screened_top_k(opts))
    if candidates is None:  # NaN/inf hidden states
        return None
    return sample_from_candidates(candidates, opts, generator=generator)
