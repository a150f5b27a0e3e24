"""The simulator: the engine's own scheduler and block pool on a virtual clock.

Each step is exactly the engine's (see ``sched/scheduler.py``)::

    txn = scheduler.plan(snapshot); result = apply_txn(pool, txn); out = scheduler.apply(...)

then, instead of a forward, the clock advances by :meth:`CostModel.step_time_s` of the step's
chunks and every sampling row "samples" token 0 (a request ends at its trace length: EOS is
ignored). Swap copies run beside the steps on one host link, each finishing after
``CostModel.swap_time_s``; the scheduler is told when the clock passes that time, as the engine's
swap actor would. Requests arrive at their trace times; when nothing can run the clock jumps to
the next arrival or swap completion.

Systems: ``paged`` is the engine as it is; ``orca-max``, ``orca-pow2`` and ``orca-oracle``
reserve, per request, ``max_model_len``, the next power of two of its final length, or exactly
its final length (times its number of sequences) before admitting it (:mod:`.reservation`), run
the contiguous attention kernel (no paging overhead) and no prefix caching; the scheduler is
the same.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncpaged._log import get_logger
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.txn import apply_txn, snapshot
from asyncpaged.sampled_token import SampledToken
from asyncpaged.sched.beam_search import BeamSearcher
from asyncpaged.sched.request import Request, RequestStatus, Sequence, StopCriteria
from asyncpaged.sched.scheduler import PreemptionMode, Scheduler, SchedulerConfig, SchedulerOutput
from asyncpaged.sim.cost_model import CostModel
from asyncpaged.sim.reservation import Placement, ReservingBlockPool
from asyncpaged.sim.workload import SimRequest

log = get_logger(__name__)

SYSTEMS = ("paged", "orca-max", "orca-pow2", "orca-oracle")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """The engine settings a simulation runs with (the scheduler's, and the pool's size).

    Invariant: ``system`` is one of :data:`SYSTEMS`; the baselines never use the prefix cache.
    """

    system: str = "paged"
    num_device_blocks: int
    num_host_blocks: int = 0
    block_size: int = 16
    preemption_mode: PreemptionMode = "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    enable_prefix_caching: bool = False
    max_model_len: int = 2048
    placement: Placement = "buddy"  # of the baselines' contiguous reservations

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system must be one of {SYSTEMS}, got {self.system!r}.")

    @property
    def is_paged(self) -> bool:
        return self.system == "paged"

    def reservation_tokens(self, request: SimRequest) -> int:
        """Slots a contiguous-reservation system holds for ``request`` from admission on."""
        final = request.prompt_len + request.output_len
        # Pow2 over-reserves the output positions by at most 2x (the paper's example: 32
        # positions for a 25-token output), never past the model's length.
        pow2 = min(request.prompt_len + (1 << (request.output_len - 1).bit_length()),
                   self.max_model_len)  # fmt: skip
        per_seq = {
            "orca-max": self.max_model_len,
            "orca-pow2": max(pow2, final),
            "orca-oracle": final,
        }[self.system]
        return per_seq * max(request.n, request.beam_width)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One step's decisions (request and sequence ids) and the cache right after its
    transaction."""

    step_id: int
    start_s: float
    duration_s: float
    admitted: tuple[int, ...]  # seq ids newly given blocks from the waiting queue
    preempted: tuple[str, ...]  # request ids
    scheduled: tuple[int, ...]  # seq ids computed in this step
    num_seqs: int  # sequences computed in this step (the batch size)
    num_batched_tokens: int
    num_stored_tokens: int  # filled slots of held blocks
    num_reserved_slots: int  # slots of held blocks, plus unused reservations
    num_waiting: int


@dataclass(slots=True)
class _Counters:
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    finish_s: dict[str, float] = field(default_factory=dict)


class SimEngine:
    """The scheduler core and a block pool, stepped on a virtual clock.

    Invariants: ``now_s`` never decreases; a swap is confirmed to the scheduler only once
    ``now_s`` has reached its completion time; every transaction's mandatory part fits
    (``apply_txn`` asserts it), as in the engine.
    """

    def __init__(
        self,
        config: SimConfig,
        cost: CostModel | None = None,
        *,
        seed: int = 0,
        record_decisions: bool = True,
    ) -> None:
        self.config = config
        self.cost = cost
        self.record_decisions = record_decisions
        self._seq_ids = itertools.count()
        if config.is_paged:
            self.pool: BlockPool = BlockPool(
                config.num_device_blocks,
                config.num_host_blocks,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
            )
        else:
            self.pool = ReservingBlockPool(
                config.num_device_blocks,
                config.num_host_blocks,
                block_size=config.block_size,
                placement=config.placement,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=config.block_size,
                num_device_blocks=config.num_device_blocks,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                preemption_mode=config.preemption_mode if config.num_host_blocks else "recompute",
                watermark=config.watermark,
            ),
            new_seq_id=self._seq_ids.__next__,
        )
        self.snapshot = snapshot(self.pool)
        self.now_s = 0.0
        self._link_free_s = 0.0
        self._swaps: list[tuple[float, int]] = []  # (done time, swap id), a heap
        self._rng = random.Random(seed)
        self._has_beams = False
        self.arrival_s: dict[str, float] = {}
        self.counters = _Counters()
        self.records: list[StepRecord] = []

    # ---- requests ---------------------------------------------------------------------------

    def add(self, spec: SimRequest, prompt_token_ids: Iterable[int] | None = None) -> None:
        """Queue a request now (sequence ids are handed out in add order, as the engine's
        intake does). Without ``prompt_token_ids`` the prompt is ``prompt_len`` zeros."""
        tokens = list(prompt_token_ids) if prompt_token_ids is not None else [0] * spec.prompt_len
        seq = Sequence(
            seq_id=next(self._seq_ids), index=0, token_ids=tokens, num_prompt_tokens=len(tokens)
        )
        stop = StopCriteria(max_tokens=spec.output_len, ignore_eos=True)
        request = Request(
            request_id=spec.request_id,
            arrival=len(self.arrival_s),
            seqs=[seq],
            stop=stop,
            num_samples=spec.n,
            fork_ids=tuple(next(self._seq_ids) for _ in range(spec.n - 1)),
        )
        if spec.beam_width > 1:
            self._has_beams = True
            request.beam = BeamSearcher(
                width=spec.beam_width,
                max_tokens=spec.output_len,
                eos_token_ids=frozenset(),
                ignore_eos=True,
            )
            request.beam.start(seq.seq_id)
        if isinstance(self.pool, ReservingBlockPool):
            request.cache_salt = spec.request_id  # names its reservation (see .reservation)
            self.pool.reserve(spec.request_id, self.config.reservation_tokens(spec))
        self.arrival_s[spec.request_id] = spec.arrival_s
        self.scheduler.add_request(request)

    # ---- stepping ---------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """A step now could do something (the engine actor's test)."""
        s = self.scheduler
        return (
            s.has_pending_txn_work
            or bool(s.running or s.waiting)
            or any(r.status is RequestStatus.SWAPPED for r in s.swapped)
        )

    @property
    def next_swap_s(self) -> float | None:
        return self._swaps[0][0] if self._swaps else None

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t`` (not backwards) and confirm the swaps done by then."""
        self.now_s = max(self.now_s, t)
        while self._swaps and self._swaps[0][0] <= self.now_s:
            _, swap_id = heapq.heappop(self._swaps)
            self.scheduler.complete_swap(swap_id)

    def step(self) -> StepRecord:
        """Plan, apply and "execute" one step at the current time; the clock moves past it."""
        sched, cfg = self.scheduler, self.config
        txn = sched.plan(self.snapshot)
        result = apply_txn(self.pool, txn)
        self.snapshot = result.snapshot
        out = sched.apply(txn, result)
        self._start_swaps(out)
        duration = 0.0
        if out.seqs and self.cost is not None:
            chunks = [(s.start_pos, len(s.slot_mapping)) for s in out.seqs]
            rows = sum([s.num_samples for s in out.seqs if s.samples])
            duration = self.cost.step_time_s(chunks, rows, paged=cfg.is_paged)
        stats = result.snapshot.statistics
        outstanding = getattr(self.pool, "num_outstanding_blocks", 0)
        record = StepRecord(
            step_id=out.step_id,
            start_s=self.now_s,
            duration_s=duration,
            admitted=tuple(g.seq_id for _, gs in result.admitted for g in gs)
            if self.record_decisions
            else (),
            preempted=out.preempted,
            scheduled=tuple(s.seq_id for s in out.seqs) if self.record_decisions else (),
            num_seqs=len(out.seqs),
            num_batched_tokens=out.num_batched_tokens,
            num_stored_tokens=stats.num_filled_device_slots,
            num_reserved_slots=(stats.num_held_device_blocks + outstanding) * cfg.block_size,
            num_waiting=len(sched.waiting),
        )
        self.records.append(record)
        self.now_s += duration
        self._finish_step(out)
        return record

    def _start_swaps(self, out: SchedulerOutput) -> None:
        for plan in (*out.swap_outs, *out.swap_ins):
            num_blocks = len(plan.block_mapping)
            if plan in out.swap_outs:
                self.counters.swap_out_blocks += num_blocks
            else:
                self.counters.swap_in_blocks += num_blocks
            cost = self.cost.swap_time_s(num_blocks, self.config.block_size) if self.cost else 0.0
            done = max(self.now_s, self._link_free_s) + cost
            self._link_free_s = done
            heapq.heappush(self._swaps, (done, plan.swap_id))

    def _finish_step(self, out: SchedulerOutput) -> None:
        # every simulated draw samples token 0 (a beam's row: its fake best tokens)
        beams, new = self._has_beams, tuple.__new__
        sampled = [
            new(SampledToken, (s.seq_id, 0, None, None, self._fake_top(s.request_id) if beams
                               else (), i, None, (), ()))
            for s in out.seqs
            if s.samples
            for i in range(s.num_samples)
        ]  # fmt: skip
        updates = self.scheduler.update(out, sampled)
        requests = self.scheduler.requests
        finished = {
            u.request_id
            for u in updates
            if u.finish_reason is not None and u.request_id not in requests
        }
        finished.update(rid for rid, _ in self.scheduler.finished_beams)
        self.scheduler.finished_beams.clear()
        for rid in finished:
            self.counters.finish_s[rid] = self.now_s

    def _fake_top(self, request_id: str) -> tuple[tuple[int, float], ...]:
        request = self.scheduler.requests.get(request_id)
        if request is None or request.beam is None:
            return ()
        k = 2 * request.beam.width
        logprobs = sorted((-self._rng.expovariate(1.0) for _ in range(k)), reverse=True)
        return tuple(enumerate(logprobs))

    # ---- a whole trace ------------------------------------------------------------------------

    def run(
        self,
        requests: Iterable[SimRequest],
        prompts: dict[str, list[int]] | None = None,
        max_steps: int | None = None,
    ) -> None:
        """Replay ``requests`` (each added at its ``arrival_s``) until all have finished."""
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        prompts = prompts or {}
        steps = 0
        while True:
            while pending and pending[0].arrival_s <= self.now_s:
                spec = pending.popleft()
                self.add(spec, prompts.get(spec.request_id))
            self.advance_to(self.now_s)
            if self.has_work:
                had_txn_work = self.scheduler.has_pending_txn_work
                record = self.step()
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    raise RuntimeError(f"the simulation did not finish in {max_steps} steps.")
                if record.num_batched_tokens or had_txn_work:
                    continue
            upcoming = [t for t in (self.next_swap_s,) if t is not None]
            if pending:
                upcoming.append(pending[0].arrival_s)
            if not upcoming:
                if self.scheduler.has_unfinished:
                    raise RuntimeError("the simulation stalled: requests left, nothing to run.")
                return
            self.advance_to(max(self.now_s, min(upcoming)))
