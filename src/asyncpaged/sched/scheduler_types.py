"""The scheduler's configuration and the values it hands out: a step's plan for the executor
(:class:`SchedulerOutput`), per-completion results (:class:`EngineCoreOutput`), statistics, and the
budgets of a step being planned (:class:`PlanBudget`). Also the one queue helper every part of the
scheduler shares (:func:`insort`: queues stay sorted by :attr:`Request.queue_key`)."""

from __future__ import annotations

import bisect
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal, NamedTuple

from asyncpaged.kv.block_table import SwapPlan
from asyncpaged.kv.txn import PriorityPreemption
from asyncpaged.sampled_token import SampledToken
from asyncpaged.sched.policy import DEFAULT_AGING_STEPS, SchedulingPolicy
from asyncpaged.sched.request import Request

PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    block_size: int = 16
    num_device_blocks: int = 1024
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: PreemptionMode = "recompute"
    watermark: float = 0.01  # share of device blocks kept free when admitting or swapping in
    # A longrope model's original_max_position_embeddings: a request longer than this rotates
    # every token with the long factors, so one that grows past it is recomputed from scratch
    # (transformers' Phi-3 generate drops its cache then); None for every other model.
    rope_switch_len: int | None = None
    # Queue order and victims (sched/policy.py): "fcfs", or "priority" (lower first, with aging)
    scheduling_policy: SchedulingPolicy = "fcfs"
    priority_aging_steps: int = DEFAULT_AGING_STEPS
    # Speculative decoding proposes nothing while more sequences than this run (vLLM's
    # ``disable_by_batch_size``: at large batches the verification rows cost more than they
    # save); None: at any batch size.
    spec_disable_by_batch_size: int | None = None
    # Async scheduling with speculative decoding: a step goes ahead of the one in flight only
    # where no sequence that one samples would propose next (its proposals need that token),
    # so here a decode whose proposer finds nothing backs off as a round that keeps nothing
    # does, and each back-off ends on a plan whose count is a multiple of its length: the
    # sequences' attempts coincide and the steps between them go ahead (``back_off``).
    spec_async: bool = False
    # LoRA (EngineConfig.max_loras; 0: off): the requests holding blocks use at most this many
    # distinct adapters, so each step's adapters fit the runner's slots.
    max_loras: int = 0


# Hot paths build the named tuples below with tuple.__new__ and every field in order (a named
# tuple's own constructor is a Python function call per row); the guards at the end of this
# module fail the import if their fields change.
new_tuple = tuple.__new__


class ScheduledSeq(NamedTuple):
    """One sequence's part of a step: K/V of ``token_ids`` (positions from ``start_pos``) go to
    ``slot_mapping``; if ``samples``, the logits of the last of them are sampled."""

    request_id: str
    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    slot_mapping: tuple[int, ...]
    block_table: tuple[int, ...]
    samples: bool
    num_samples: int = 1  # > 1: the prompt's end of a parallel-sampling request (its fork)
    min_rope_len: int = 0  # the RoPE scaling sees at least this length (longrope's long regime)
    # Speculative decoding: the last ``num_draft`` of ``token_ids`` are proposals; the logits of
    # the last ``num_draft + 1`` tokens verify them (the step returns 1 to num_draft + 1 tokens)
    num_draft: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    copy_on_write: tuple[tuple[int, int], ...]  # run before the forward, all layers
    swap_outs: tuple[SwapPlan, ...]
    swap_ins: tuple[SwapPlan, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int


class EngineCoreOutput(NamedTuple):
    """One completion's new tokens from one step (vLLM v1's ``EngineCoreOutput``): made by the
    core's update, given the grammar's forced tokens and stop by the scheduler actor, and
    recorded by the output processor. ``sampled`` is the runner's row of the draw that produced
    them (its logprobs, if asked). A named tuple: one per sampling row per step."""

    request_id: str
    seq_id: int
    completion: int  # the completion's index in its request
    new_token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    sampled: SampledToken


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStatistics:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_swap_outs: int
    num_swap_ins: int
    num_recomputes: int
    num_rope_restarts: int
    num_finished: int
    num_aborted: int


@dataclass(slots=True)
class PlanBudget:
    """A step being planned: budgets and the decisions made so far."""

    budget_left: int
    seqs_left: int
    free: int  # device blocks free for mandatory operations (negative: under pressure)
    short: bool = False  # some request's blocks do not fit: the allocator preempts
    # priority policy: a waiting request preempts the running groups it outranks
    preemption: PriorityPreemption | None = None
    # Async scheduling: the sequences whose next token the step in flight samples (their rows
    # take a placeholder), or None when no step is in flight
    pending: AbstractSet[int] | None = None
    cut: bool = False  # planned ahead, stopped where the sync rules would preempt or restart


def insort(queue: list[Request], request: Request) -> None:
    """Insert ``request`` into ``queue``, kept sorted by :attr:`Request.queue_key`."""
    bisect.insort(queue, request, key=_queue_key)


def _queue_key(request: Request) -> tuple[int, int]:
    return request.queue_key


assert ScheduledSeq._fields == (
    "request_id", "seq_id", "token_ids", "start_pos", "slot_mapping", "block_table", "samples",
    "num_samples", "min_rope_len", "num_draft",
), "Scheduler._schedule builds ScheduledSeq in this order"  # fmt: skip
assert EngineCoreOutput._fields == (
    "request_id", "seq_id", "completion", "new_token_ids", "finish_reason", "stop_reason",
    "sampled",
), "Scheduler._append_one builds EngineCoreOutput in this order"  # fmt: skip
