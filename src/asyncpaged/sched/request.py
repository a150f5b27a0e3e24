"""Request and sequence state owned by the scheduler (pure Python, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncpaged.sched.beam_search import BeamSearcher


class RequestStatus(enum.Enum):
    """Where a request (a sequence group) is in the scheduler.

    ``WAITING`` (new, or preempted by recompute) -> ``RUNNING`` -> ``SWAPPING_OUT`` -> ``SWAPPED``
    -> ``SWAPPING_IN`` -> ``RUNNING`` -> ``FINISHED``. Any state can go to ``FINISHED`` (abort).
    """

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPING_OUT = "swapping_out"
    SWAPPED = "swapped"
    SWAPPING_IN = "swapping_in"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True, kw_only=True)
class StopCriteria:
    """The token-level stop rules the scheduler applies (stop strings are the detokenizer's).

    ``max_tokens`` counts generated tokens; an EOS id (unless ``ignore_eos``) and
    ``stop_token_ids`` end a sequence only once ``min_tokens`` tokens were generated.
    ``eos_token_ids`` are the model's end ids: the tokenizer's EOS and every id of its
    ``generation_config.json`` (Llama 3 and chat models list end-of-turn ids there).
    """

    max_tokens: int
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    """One output sequence of a request.

    Invariant: ``num_computed_tokens <= len(token_ids)``; the K/V of ``token_ids[:num_computed]``
    are in (or being written to) the sequence's blocks. A running sequence that finished its
    prompt has ``num_computed_tokens == len(token_ids) - 1``: its last, sampled token is the
    input of its next decode step; or less, after a grammar forced tokens (jump-forward,
    ``Scheduler.append_forced``): the next step computes them all as a chunk. Async scheduling
    (``Scheduler.plan(ahead=...)``): a step planned before the last one's token came back
    computes that token's position too, so ``num_computed_tokens == len(token_ids) + 1``
    until the token is appended.
    """

    seq_id: int
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    has_blocks: bool = False  # the pool holds a table for it (or will, until a pending free)
    # Speculative decoding's back-off: decode steps to skip proposing, and the last back-off
    # (doubled after each round that kept no proposal, up to 16; reset by one that kept one)
    spec_skip: int = 0
    spec_backoff: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(slots=True, eq=False)
class Request:
    """A sequence group: the unit of admission, preemption and swapping (all-or-nothing).

    A parallel-sampling request starts with one sequence; the step that computes the end of its
    prompt samples ``num_samples`` tokens from it, and the other sequences (ids ``fork_ids``) are
    forked from it then, sharing the prompt's blocks.
    """

    request_id: str
    arrival: int  # admission order key (first come, first served)
    seqs: list[Sequence]
    stop: StopCriteria
    cache_salt: str | None = None
    lora_key: str | None = None  # the content digest of the request's LoRA adapter (None: base)
    status: RequestStatus = RequestStatus.WAITING
    num_samples: int = 1  # sequences to sample from the prompt (best_of, or n)
    fork_ids: tuple[int, ...] = ()  # seq ids for sequences 1.. of a parallel-sampling request
    pin_id: int | None = None  # compute the prompt, then pin its full blocks under this id
    beam: BeamSearcher | None = None  # a beam-search request: its live sequences are the beams
    beam_top: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    long_rope: bool = False  # a longrope model's request past original_max_position_embeddings
    # False while the request's prompt logprobs are not all computed: it maps no cached block
    read_prefix_cache: bool = True
    swap_id: int | None = None
    num_swap_blocks: int = 0  # blocks of its last swap-out: what a swap-in takes back
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    metadata: dict[str, object] = field(default_factory=dict)
    # Scheduling policy (sched/policy.py): the caller's priority (lower first), the effective
    # priority the queues sort by (priority minus the aging credit), and the plans it waited
    priority: int = 0
    effective_priority: int = 0
    num_wait_steps: int = 0
    # Speculative decoding: proposals per decode step (0: none; set by the intake)
    num_speculative_tokens: int = 0

    @property
    def queue_key(self) -> tuple[int, int]:
        """The order of every queue: effective priority, then arrival (all 0 under FCFS)."""
        return (self.effective_priority, self.arrival)

    @property
    def cache_key(self) -> str | None:
        """The prefix-cache key of the request's blocks: its ``cache_salt``, marked for the
        long RoPE regime of a longrope model (K/V rotated with the long factors never serve a
        short sequence, nor the reverse), and keyed on the content digest of its LoRA adapter
        (blocks computed with one adapter never serve another, nor the base model). User salts
        cannot contain NUL, so no salt equals these."""
        salt = self.cache_salt
        if self.lora_key is not None:
            salt = f"\x00lora\x00{self.lora_key}\x00{salt or ''}"
        if not self.long_rope:
            return salt
        return f"\x00longrope\x00{salt or ''}"

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.finish_reason is None]

    @property
    def is_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)
