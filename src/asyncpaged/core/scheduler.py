"""Iteration-level, first-come-first-served scheduling over the block pool (pure Python).

One call of :meth:`Scheduler.schedule` plans one model step::

    1. running requests, oldest first: a decode token per sequence, or the next prefill chunk;
       a request that cannot get its blocks preempts the newest running request (all its
       sequences: by swap to the host pool, or by recompute) until it fits, or waits a step
       when blocks being swapped out will free enough;
    2. if nothing was preempted: swapped requests come back in (oldest first);
    3. if nothing is preempted or swapped: waiting requests are admitted, oldest first, within
       the token budget, keeping a watermark of free blocks (chunked prefill).

:meth:`Scheduler.update` then takes the sampled tokens, applies the stop rules and frees what
finished. The caller alternates ``schedule`` and ``update`` strictly (one step in flight), runs the
step's copy-on-write copies before its forward, and calls :meth:`Scheduler.complete_swap` when a
swap's copies are done.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from asyncpaged.core.block_pool import BlockPool
from asyncpaged.core.block_table import SwapDirection, SwapPlan
from asyncpaged.core.request import Request, RequestStatus, Sequence

PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: PreemptionMode = "recompute"
    watermark: float = 0.01  # share of device blocks kept free when admitting or swapping in


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledSeq:
    """One sequence's part of a step: K/V of ``token_ids`` (positions from ``start_pos``) go to
    ``slot_mapping``; if ``samples``, the logits of the last of them are sampled."""

    request_id: str
    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    slot_mapping: tuple[int, ...]
    block_table: tuple[int, ...]
    samples: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput:
    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    copy_on_write: tuple[tuple[int, int], ...]  # run before the forward, all layers
    swap_outs: tuple[SwapPlan, ...]
    swap_ins: tuple[SwapPlan, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqUpdate:
    request_id: str
    seq_id: int
    index: int
    new_token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerStatistics:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_swap_outs: int
    num_swap_ins: int
    num_recomputes: int
    num_finished: int
    num_aborted: int


class Scheduler:
    """FCFS iteration-level scheduler owning the queues and the block pool.

    Invariants:

    * Every unfinished request is in exactly one of ``waiting``, ``running`` and ``swapped``,
      each kept sorted by arrival; finished requests are dropped at once.
    * Waiting requests hold no blocks; the live sequences of a running request have device
      tables; those of a swapped request are on the host or in flight.
    * Preemption and swapping move whole requests (all live sequences together).
    * No request is admitted while another is swapped or was preempted in the same step.
    """

    def __init__(self, pool: BlockPool, config: SchedulerConfig | None = None) -> None:
        self.pool = pool
        self.config = config or SchedulerConfig()
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._swaps: dict[int, Request | None] = {}
        self._step_ids = itertools.count()
        self._watermark_blocks = math.ceil(self.config.watermark * pool.device.num_blocks)
        self.num_preemptions = self.num_swap_outs = self.num_swap_ins = 0
        self.num_recomputes = self.num_finished = self.num_aborted = 0

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate id {request.request_id!r}"
        assert request.status is RequestStatus.WAITING
        assert len(request.live_seqs) == 1, "a request starts with one sequence"
        self.requests[request.request_id] = request
        _insort(self.waiting, request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request with reason "abort" wherever it is and free its blocks now."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        self._finish(request)
        self.num_aborted += 1
        return request

    def complete_swap(self, swap_id: int) -> None:
        """A swap's copies are done: the request becomes swapped, or running again."""
        request = self._swaps.pop(swap_id)
        self.pool.complete_swap(swap_id)
        if request is None:  # aborted while its blocks were being copied
            return
        request.swap_id = None
        if request.status is RequestStatus.SWAPPING_OUT:
            request.status = RequestStatus.SWAPPED
        else:
            assert request.status is RequestStatus.SWAPPING_IN
            self.swapped.remove(request)
            request.status = RequestStatus.RUNNING
            _insort(self.running, request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_swaps_in_flight(self) -> bool:
        return bool(self._swaps)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swap_ins(step)
        if not step.preempted and not self.swapped:
            self._schedule_waiting(step)
        return SchedulerOutput(
            step_id=next(self._step_ids),
            seqs=tuple(step.seqs),
            copy_on_write=tuple(step.cow),
            swap_outs=tuple(step.swap_outs),
            swap_ins=tuple(step.swap_ins),
            preempted=tuple(step.preempted),
            num_batched_tokens=step.num_tokens,
        )

    def _schedule_running(self, step: _StepBuilder) -> None:
        coming = 0  # device blocks that swaps started this step will free when done
        i = 0
        while i < len(self.running):
            request = self.running[i]
            chunks = step.chunks_for(request)
            if chunks is None:
                return  # token or sequence budget spent
            need = sum(self.pool.num_blocks_to_append(s.seq_id, n) for s, n in chunks)
            while need > self.pool.num_free_device_blocks:
                if need <= self.pool.num_free_device_blocks + coming:
                    return  # wait a step for the swap-outs to land
                victim = self.running[-1]
                coming += self._preempt(victim, step)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                return  # it preempted itself
            for seq, n in chunks:
                start = seq.num_computed_tokens
                tokens = seq.token_ids[start : start + n]
                result = self.pool.append(seq.seq_id, tokens)
                assert result is not None, "capacity was checked"
                step.cow.extend(result.copy_on_write)
                step.add(request, seq, tokens, start, result.slot_mapping, self.pool)
            i += 1

    def _schedule_swap_ins(self, step: _StepBuilder) -> None:
        for request in list(self.swapped):
            if request.status is not RequestStatus.SWAPPED:
                continue
            seq_ids = [s.seq_id for s in request.live_seqs]
            need = self.pool.num_blocks_to_swap(seq_ids, SwapDirection.IN)
            if need + self._watermark_blocks > self.pool.num_free_device_blocks:
                return  # first come, first served: no one overtakes
            plan = self.pool.swap_in(seq_ids)
            assert plan is not None
            request.status = RequestStatus.SWAPPING_IN
            request.swap_id = plan.swap_id
            self._swaps[plan.swap_id] = request
            step.swap_ins.append(plan)
            self.num_swap_ins += 1

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        while self.waiting:
            request = self.waiting[0]
            seqs = request.live_seqs
            if step.num_seqs + len(seqs) > step.max_seqs or step.budget_left < len(seqs):
                return
            chunk = step.budget_left // len(seqs)
            need = sum(
                self.pool.num_blocks_to_allocate(
                    s.token_ids, max_new_tokens=chunk, extra_key=request.cache_salt
                )
                for s in seqs
            )
            watermark = self._watermark_blocks if self.running else 0
            if need + watermark > self.pool.num_free_device_blocks:
                return
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            _insort(self.running, request)
            for seq in seqs:
                alloc = self.pool.allocate(
                    seq.seq_id, seq.token_ids, max_new_tokens=chunk, extra_key=request.cache_salt
                )
                assert alloc is not None, "capacity was checked"
                seq.num_computed_tokens = alloc.num_cached_tokens
                request.num_cached_tokens = max(request.num_cached_tokens, alloc.num_cached_tokens)
                n = len(alloc.slot_mapping)
                tokens = seq.token_ids[alloc.num_cached_tokens : alloc.num_cached_tokens + n]
                step.add(
                    request, seq, tokens, alloc.num_cached_tokens, alloc.slot_mapping, self.pool
                )

    def _preempt(self, request: Request, step: _StepBuilder) -> int:
        """Preempt a running request; returns device blocks its swap-out frees on completion."""
        self.running.remove(request)
        step.drop(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.append(request.request_id)
        seq_ids = [s.seq_id for s in request.live_seqs]
        plan = self.pool.swap_out(seq_ids) if self.config.preemption_mode == "swap" else None
        if plan is None:  # recompute, or the host pool is full
            for seq in request.live_seqs:
                self.pool.free(seq.seq_id)
                seq.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            _insort(self.waiting, request)
            self.num_recomputes += 1
            return 0
        request.status = RequestStatus.SWAPPING_OUT
        request.swap_id = plan.swap_id
        self._swaps[plan.swap_id] = request
        _insort(self.swapped, request)
        step.swap_outs.append(plan)
        self.num_swap_outs += 1
        return self.pool.num_blocks_freed_by_swap(plan.swap_id)

    # ---- after the step -------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Mapping[int, int]) -> list[SeqUpdate]:
        """Append each sampled token, apply the stop rules, free finished sequences."""
        updates: list[SeqUpdate] = []
        for scheduled in output.seqs:
            request = self.requests.get(scheduled.request_id)
            if request is None or not scheduled.samples:
                continue  # aborted meanwhile, or a prefill chunk short of the prompt's end
            seq = next(s for s in request.seqs if s.seq_id == scheduled.seq_id)
            if seq.is_finished:
                continue
            token = sampled[seq.seq_id]
            seq.token_ids.append(token)
            finished = self._check_stop(request, seq, token)
            updates.append(
                SeqUpdate(
                    request_id=request.request_id,
                    seq_id=seq.seq_id,
                    index=seq.index,
                    new_token_ids=(token,),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            if finished:
                self.pool.free(seq.seq_id)
                if request.is_finished:
                    self._finish(request)
                    self.num_finished += 1
        return updates

    def finish_seq(self, request_id: str, seq_id: int, reason: str, stop: int | str | None) -> None:
        """End a sequence from outside (a stop string matched in its text)."""
        request = self.requests[request_id]
        seq = next(s for s in request.seqs if s.seq_id == seq_id)
        if seq.is_finished:
            return
        seq.finish_reason, seq.stop_reason = reason, stop
        self.pool.free(seq.seq_id)
        if request.is_finished:
            self._finish(request)
            self.num_finished += 1

    def _check_stop(self, request: Request, seq: Sequence, token: int) -> bool:
        """Set the sequence's finish reason if ``token`` ends it; True if it did."""
        stop = request.stop
        if seq.num_generated >= stop.min_tokens:
            if token == stop.eos_token_id and not stop.ignore_eos:
                seq.finish_reason = "stop"
            elif token in stop.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finish_reason is None and (
            seq.num_generated >= stop.max_tokens
            or (stop.max_model_len is not None and len(seq.token_ids) >= stop.max_model_len)
        ):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _finish(self, request: Request) -> None:
        """Drop a finished request from its queue and free whatever it still holds."""
        del self.requests[request.request_id]
        status = request.status
        request.status = RequestStatus.FINISHED
        if status is RequestStatus.WAITING:
            self.waiting.remove(request)
            return
        if status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.swapped.remove(request)
            if request.swap_id is not None:
                self._swaps[request.swap_id] = None
        for seq in request.seqs:
            if self.pool.has_seq(seq.seq_id):
                self.pool.free(seq.seq_id)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_preemptions=self.num_preemptions,
            num_swap_outs=self.num_swap_outs,
            num_swap_ins=self.num_swap_ins,
            num_recomputes=self.num_recomputes,
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
        )


class _StepBuilder:
    """Accumulates one step's plan within the token and sequence budgets."""

    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.budget_left = max_tokens
        self.max_seqs = max_seqs
        self.num_seqs = 0
        self.num_tokens = 0
        self.seqs: list[ScheduledSeq] = []
        self.cow: list[tuple[int, int]] = []
        self.swap_outs: list[SwapPlan] = []
        self.swap_ins: list[SwapPlan] = []
        self.preempted: list[str] = []

    def chunks_for(self, request: Request) -> list[tuple[Sequence, int]] | None:
        """(sequence, tokens to compute) for a running request, or None if over budget."""
        seqs = request.live_seqs
        if self.num_seqs + len(seqs) > self.max_seqs or self.budget_left < len(seqs):
            return None
        share = self.budget_left // len(seqs)
        return [(s, min(s.num_uncomputed, share)) for s in seqs]

    def add(
        self,
        request: Request,
        seq: Sequence,
        tokens: list[int],
        start: int,
        slots: tuple[int, ...],
        pool: BlockPool,
    ) -> None:
        seq.num_computed_tokens = start + len(tokens)
        self.seqs.append(
            ScheduledSeq(
                request_id=request.request_id,
                seq_id=seq.seq_id,
                token_ids=tuple(tokens),
                start_pos=start,
                slot_mapping=slots,
                block_table=pool.block_ids(seq.seq_id),
                samples=seq.num_computed_tokens == len(seq.token_ids),
            )
        )
        self.num_seqs += 1
        self.num_tokens += len(tokens)
        self.budget_left -= len(tokens)

    def drop(self, request: Request) -> None:
        """Forget a request scheduled earlier in this step (it was preempted after all)."""
        assert all(s.request_id != request.request_id for s in self.seqs), (
            "a request scheduled in this step cannot be preempted in it"
        )


def _insort(queue: list[Request], request: Request) -> None:
    bisect.insort(queue, request, key=lambda r: r.arrival)
