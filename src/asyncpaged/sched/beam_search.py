"""Beam search decisions for one request, mirroring transformers' ``_beam_search`` (v5).

Per step, with ``k`` beams: every running beam offers its top ``2k`` next tokens, scored by the
beam's cumulative logprob plus the token's logprob; the best ``2k`` candidates overall are kept.
Candidates that end (EOS, unless ignored, or ``max_tokens`` reached) and rank among the first
``k`` become finished hypotheses, scored ``cumulative logprob / generated_len ** length_penalty``
(the ``k`` best kept); the best ``k`` candidates that do not end are the next running beams.

Stopping, as transformers with ``early_stopping``:

* ``False`` (default): stop once ``k`` hypotheses are finished and the best running beam, scored
  at its current length, cannot beat the worst of them (a heuristic with length penalties);
* ``True``: stop as soon as ``k`` hypotheses are finished;
* ``"never"``: like ``False``, but with a positive length penalty the best running beam is scored
  at ``max_tokens`` (the canonical algorithm with ``length_penalty=0``);
* and always when every kept candidate ends.

Candidates with equal scores are ordered as ``torch.topk`` over the flattened ``[beam, vocab]``
scores orders them in practice: by beam, then token id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

NEG_INF = -1.0e9

EarlyStopping = bool | Literal["never"]


@dataclass(slots=True)
class Beam:
    seq_id: int
    tokens: list[int]  # generated tokens
    score: float  # sum of token logprobs


@dataclass(frozen=True, slots=True)
class Hypothesis:
    tokens: tuple[int, ...]
    score: float  # length-penalized
    logprob: float  # sum of token logprobs


@dataclass(frozen=True, slots=True)
class BeamChoice:
    """A next running beam: ``parent``'s tokens plus ``token``."""

    parent: int
    token: int
    score: float


@dataclass(slots=True)
class BeamSearcher:
    """The beam state of one request.

    Invariants: ``len(running) <= width`` (exactly ``width`` after the first step), sorted by
    score, all with the same number of tokens; ``len(finished) <= width``, sorted by score.
    """

    width: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    ignore_eos: bool = False
    running: list[Beam] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    def start(self, seq_id: int) -> None:
        self.running = [Beam(seq_id=seq_id, tokens=[], score=0.0)]

    def step(self, top: Mapping[int, Sequence[tuple[int, float]]]) -> list[BeamChoice]:
        """Advance one token; ``top[seq_id]`` is the running beam's ``2 * width`` best
        (token, logprob), best first. Returns the next running beams (empty when done)."""
        k, keep = self.width, 2 * self.width
        length = len(self.running[0].tokens) + 1  # generated tokens after this step
        cands: list[tuple[float, int, int, Beam]] = []
        for b, beam in enumerate(self.running):
            for token, logprob in top[beam.seq_id][:keep]:
                cands.append((beam.score + logprob, b, token, beam))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[:keep]
        ends = [self._ends(token, length) for _, _, token, _ in cands]
        # Finished hypotheses: ending candidates among the first k, if they can still count.
        eligible = self.improvable and not (self.early_stopping is True and len(self.finished) == k)
        if eligible:
            for i in range(min(k, len(cands))):
                if ends[i]:
                    score, _, token, beam = cands[i]
                    penalized = score / length**self.length_penalty
                    hyp = Hypothesis((*beam.tokens, token), penalized, score)
                    self.finished.append(hyp)
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[k:]
        # Next running beams: the best non-ending candidates (ending ones rank last).
        order = sorted(range(len(cands)), key=lambda i: (ends[i], i))[:k]
        chosen = [cands[i] for i in order]
        self.running = [
            Beam(seq_id=-1, tokens=[*beam.tokens, token], score=score + (NEG_INF if ends[i] else 0))
            for i, (score, _, token, beam) in zip(order, chosen, strict=True)
        ]
        self._check_stop(length, all(ends))
        if self.done:
            return []
        return [
            BeamChoice(parent=beam.seq_id, token=token, score=new.score)
            for (_, _, token, beam), new in zip(chosen, self.running, strict=True)
        ]

    def _ends(self, token: int, length: int) -> bool:
        eos = token in self.eos_token_ids and not self.ignore_eos
        return eos or length >= self.max_tokens

    def _check_stop(self, length: int, all_end: bool) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = length
        best_possible = self.running[0].score / best_length**self.length_penalty
        worst = self.finished[-1].score if len(self.finished) == self.width else NEG_INF
        self.improvable = self.improvable and best_possible > worst
        full = len(self.finished) == self.width and self.early_stopping is True
        self.done = not self.improvable or full or all_end

    def assign(self, seq_ids: Sequence[int]) -> None:
        """Record which sequence now holds each running beam (in ``step``'s order)."""
        for beam, seq_id in zip(self.running, seq_ids, strict=True):
            beam.seq_id = seq_id
