"""The scheduler and block pool driven by a fake executor that simulates the KV cache.

The fake executor writes, into each slot a step hands out, what a real K/V row depends on (the
cache salt and every token up to that position); copy-on-write and swap copies move those
contents (swaps only when the driver completes them, at a random later step). A sampling
sequence reads its whole context back through its block table and must find exactly its tokens;
the next token is a hash of what it read. So any scheduling, preemption or swap bug that corrupts
a sequence's cache changes its output, and every request's output must equal the output of the
same request run alone.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import event, given

from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.block_table import SwapDirection
from asyncpaged.kv.txn import apply_txn, snapshot
from asyncpaged.sched.beam_search import BeamSearcher, Hypothesis
from asyncpaged.sched.request import Request, Sequence, StopCriteria
from asyncpaged.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.sched.rows import rows_of

BS = 4
VOCAB = 5
EOS = 4
BEAM_WIDTH = 2
Content = tuple[str | None, tuple[int, ...]]


def next_token(salt: str | None, tokens: list[int] | tuple[int, ...], draw: int = 0) -> int:
    """The fake model: a hash of the context; ``draw`` tells the fork's draws apart."""
    digest = hashlib.sha256(repr((salt, tuple(tokens), draw)).encode()).digest()
    return digest[0] % VOCAB


def fake_top(
    salt: str | None, tokens: list[int] | tuple[int, ...]
) -> tuple[tuple[int, float], ...]:
    """The fake model's next-token logprobs, best first (ties by token id)."""
    logits = [
        hashlib.sha256(repr((salt, tuple(tokens), v)).encode()).digest()[1] / 32.0
        for v in range(VOCAB)
    ]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return tuple(sorted(((v, x - norm) for v, x in enumerate(logits)), key=lambda p: (-p[1], p[0])))


def reference_beams(
    prompt: list[int], salt: str | None, searcher: BeamSearcher
) -> list[Hypothesis]:
    """The beam search of one request run alone on the fake model."""
    histories = {0: list(prompt)}
    searcher.start(0)
    ids = itertools.count(1)
    while True:
        choices = searcher.step({b: fake_top(salt, h)[: 2 * searcher.width]
                                 for b, h in histories.items()})  # fmt: skip
        if searcher.done:
            return searcher.finished
        new = {next(ids): [*histories[c.parent], c.token] for c in choices}
        searcher.assign(list(new))
        histories = new


def reference_output(
    prompt: list[int], salt: str | None, stop: StopCriteria, index: int = 0
) -> list[int]:
    """Sequence ``index`` of the request run alone: its first token is draw ``index``."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        tok = next_token(salt, tokens, index if not out else 0)
        tokens.append(tok)
        out.append(tok)
        if len(out) >= stop.min_tokens and tok in stop.eos_token_ids and not stop.ignore_eos:
            return out
        if len(out) >= stop.max_tokens:
            return out


@dataclass
class FakeWorld:
    """Device and host KV contents, and the swaps in flight."""

    device: dict[int, Content | None] = field(default_factory=dict)
    host: dict[int, Content | None] = field(default_factory=dict)
    swaps: dict[int, tuple[SwapDirection, tuple[tuple[int, int], ...]]] = field(
        default_factory=dict
    )

    def copy_blocks(self, src: dict[int, Content | None], dst: dict[int, Content | None],
                    pairs: tuple[tuple[int, int], ...]) -> None:  # fmt: skip
        for s, d in pairs:
            for off in range(BS):
                dst[d * BS + off] = src.get(s * BS + off)

    def execute(
        self, out: SchedulerOutput, requests: dict[str, Request]
    ) -> tuple[dict[int, list[int]], dict[int, tuple[tuple[int, float], ...]]]:
        self.copy_blocks(self.device, self.device, out.copy_on_write)
        for plan in (*out.swap_outs, *out.swap_ins):
            self.swaps[plan.swap_id] = (plan.direction, plan.block_mapping)
            if plan.direction is SwapDirection.IN:  # destinations hold garbage until copied
                for _, d in plan.block_mapping:
                    for off in range(BS):
                        self.device[d * BS + off] = None
        sampled: dict[int, list[int]] = {}
        tops: dict[int, tuple[tuple[int, float], ...]] = {}
        for sch in out.seqs:  # a real layer writes every new K/V before any attention reads
            request = requests[sch.request_id]
            seq = next(s for s in request.seqs if s.seq_id == sch.seq_id)
            for i, slot in enumerate(sch.slot_mapping):
                pos = sch.start_pos + i
                self.device[slot] = (request.cache_salt, tuple(seq.token_ids[: pos + 1]))
        for sch in out.seqs:
            if not sch.samples:
                continue
            request = requests[sch.request_id]
            seq = next(s for s in request.seqs if s.seq_id == sch.seq_id)
            n = sch.start_pos + len(sch.token_ids)
            assert n == len(seq.token_ids)
            for pos in range(n):
                slot = sch.block_table[pos // BS] * BS + pos % BS
                want = (request.cache_salt, tuple(seq.token_ids[: pos + 1]))
                assert self.device.get(slot) == want, f"{sch.request_id} reads bad KV at {pos}"
            if request.beam is not None:
                tops[sch.seq_id] = fake_top(request.cache_salt, seq.token_ids)[: 2 * BEAM_WIDTH]
            first = seq.num_generated == 0
            sampled[sch.seq_id] = [
                next_token(request.cache_salt, seq.token_ids, draw if first else 0)
                for draw in range(sch.num_samples)
            ]
        return sampled, tops

    def complete(self, swap_id: int) -> None:
        direction, pairs = self.swaps.pop(swap_id)
        if direction is SwapDirection.OUT:
            self.copy_blocks(self.device, self.host, pairs)
        else:
            self.copy_blocks(self.host, self.device, pairs)


def between_steps(
    data: st.DataObject,
    world: FakeWorld,
    sched: Scheduler,
    add: Callable[[], None],
    num_placeholders: int,
    aborted: set[str],
    *,
    abort_one_in: int,
) -> int:
    """What happens between two steps, at random: swaps land (each in flight, or not yet), a
    late request arrives (``add``), a request is aborted (one time in ``abort_one_in``);
    returns how many late requests are still to come."""
    for swap_id in sorted(world.swaps):
        if data.draw(st.booleans(), label="complete swap"):
            world.complete(swap_id)
            sched.complete_swap(swap_id)
    if num_placeholders and data.draw(st.booleans(), label="arrive"):
        add()
        num_placeholders -= 1
    if sched.requests and data.draw(st.integers(0, abort_one_in - 1), label="abort?") == 0:
        rid = data.draw(st.sampled_from(sorted(sched.requests)), label="abort which")
        sched.abort(rid)
        aborted.add(rid)
    return num_placeholders


BASE = [1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 1, 1, 0, 0, 3, 3, 1, 2, 3, 0]


@st.composite
def request_specs(draw: st.DrawFn, max_len: int) -> tuple[list[int], str | None, StopCriteria]:
    n_prefix = draw(st.integers(0, len(BASE)))
    tail = draw(st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=12))
    prompt = (BASE[:n_prefix] + tail)[: max_len - 1]
    max_tokens = draw(st.integers(1, min(16, max_len - len(prompt))))
    stop = StopCriteria(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        eos_token_ids=frozenset({EOS}),
        ignore_eos=draw(st.booleans()),
    )
    return prompt, draw(st.sampled_from([None, None, "salt"])), stop


@given(data=st.data())
def test_scheduler_outputs_equal_running_each_request_alone(data: st.DataObject) -> None:
    num_device = data.draw(st.integers(6, 24), label="device blocks")
    num_host = data.draw(st.integers(0, 24), label="host blocks")
    mode = data.draw(st.sampled_from(["recompute", "swap"]), label="mode")
    config = SchedulerConfig(
        block_size=BS,
        num_device_blocks=num_device,
        max_num_seqs=data.draw(st.integers(1, 8)),
        max_num_batched_tokens=data.draw(st.integers(4, 48)),
        preemption_mode=mode,
        # longrope: requests that grow past it restart from their first token (a new cache key)
        rope_switch_len=data.draw(st.sampled_from([None, None, 5, 9]), label="rope switch"),
    )
    pool = BlockPool(
        num_device, num_host, block_size=BS, enable_prefix_caching=data.draw(st.booleans())
    )
    sched = Scheduler(config)
    snap = snapshot(pool)
    world = FakeWorld()
    max_len = (num_device - 1) * BS  # a request alone always fits
    ids = itertools.count()
    expected: dict[tuple[str, int], list[int]] = {}
    expected_beams: dict[str, list[Hypothesis]] = {}
    got_beams: dict[str, list[Hypothesis]] = {}
    outputs: dict[tuple[str, int], list[int]] = {}
    aborted: set[str] = set()
    every: dict[str, Request] = {}

    seq_ids = itertools.count()

    def add() -> None:
        prompt, salt, stop = data.draw(request_specs(max_len))
        num_samples = data.draw(st.sampled_from([1, 1, 2, 3, 0]), label="samples (0: beams)")
        rid = f"r{next(ids)}"
        seq = Sequence(seq_id=next(seq_ids), index=0, token_ids=list(prompt),
                       num_prompt_tokens=len(prompt))  # fmt: skip
        beam = None
        if num_samples == 0:
            num_samples = 1
            knobs = {
                "width": BEAM_WIDTH,
                "max_tokens": stop.max_tokens,
                "eos_token_ids": frozenset({EOS}),
                "ignore_eos": stop.ignore_eos,
                "length_penalty": data.draw(st.sampled_from([0.0, 1.0, 2.0])),
                "early_stopping": data.draw(st.sampled_from([False, True, "never"])),
            }
            beam = BeamSearcher(**knobs)
            beam.start(seq.seq_id)
            expected_beams[rid] = reference_beams(prompt, salt, BeamSearcher(**knobs))
        fork_ids = tuple(next(seq_ids) for _ in range(num_samples - 1))
        request = Request(request_id=rid, arrival=int(rid[1:]), seqs=[seq], stop=stop,
                          cache_salt=salt, num_samples=num_samples, fork_ids=fork_ids,
                          beam=beam)  # fmt: skip
        sched.add_request(request)
        every[rid] = request
        for i in range(0 if beam else num_samples):
            expected[(rid, i)] = reference_output(prompt, salt, stop, i)
            outputs[(rid, i)] = []

    for _ in range(data.draw(st.integers(1, 12), label="initial requests")):
        add()
    num_placeholders = data.draw(st.integers(0, 8), label="late requests")
    saw_preemption = False
    for _ in range(3000):
        idle = not sched.has_unfinished and not sched.has_swaps_in_flight
        if idle and not sched.has_pending_txn_work and num_placeholders == 0:
            break
        swapped_before = bool(sched.swapped)
        waiting_before = {r.request_id for r in sched.waiting}
        txn = sched.plan(snap)
        result = apply_txn(pool, txn)  # asserts that every mandatory operation fits
        snap = result.snapshot
        out = sched.apply(txn, result)
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        assert len(out.seqs) <= config.max_num_seqs
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
        admitted = {s.request_id for s in out.seqs} & waiting_before
        if swapped_before or out.preempted:
            assert not admitted, "admitted while a request was preempted or swapped"
        arrivals = [every[r].arrival for r in waiting_before]
        if admitted:  # first come, first served among the waiting
            assert (
                max(every[r].arrival for r in admitted)
                <= min(every[r].arrival for r in waiting_before - admitted)
                if waiting_before - admitted
                else True
            )
        del arrivals
        if out.preempted:  # the newest running requests are the victims
            newest_kept = max((r.arrival for r in sched.running), default=-1)
            assert newest_kept < min(every[r].arrival for r in out.preempted)
        saw_preemption |= bool(out.preempted)
        sampled, tops = world.execute(out, every)
        for upd in sched.update(out, rows_of(out, sampled, tops)):
            outputs[(upd.request_id, upd.completion)].extend(upd.new_token_ids)
        for rid, hypotheses in sched.finished_beams:
            got_beams[rid] = hypotheses
        sched.finished_beams.clear()
        pool.check_invariants()
        num_placeholders = between_steps(
            data, world, sched, add, num_placeholders, aborted, abort_one_in=10
        )
    else:
        raise AssertionError("the scheduler stopped making progress")
    event("preempted" if saw_preemption else "no preemption")
    stats_s = sched.statistics()
    if stats_s.num_swap_outs:
        event("swapped out")
    if stats_s.num_swap_ins:
        event("swapped in")
    if stats_s.num_recomputes:
        event("recomputed")
    if stats_s.num_rope_restarts:
        event("restarted in the long rope regime")
    if aborted:
        event("aborted")
    if any(len(r.seqs) > 1 for r in every.values()):
        event("forked")
    for rid, want_beams in expected_beams.items():
        if rid in aborted:
            continue
        event("beam search")
        assert got_beams[rid] == want_beams, rid
    for (rid, index), want in expected.items():
        got = outputs[(rid, index)]
        if rid in aborted:
            assert got == want[: len(got)]
        else:
            assert got == want, (rid, index)
            assert every[rid].seqs[index].finish_reason in ("stop", "length")
            assert every[rid].seqs[index].index == index
    stats = pool.statistics()
    assert stats.num_seqs == 0
    assert stats.device.used == stats.device.in_flight == stats.host.used == 0
    assert stats.host.free == num_host
