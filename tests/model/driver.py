"""A minimal scheduler stand-in that drives ``ModelRunner`` the way the engine will.

Physical blocks come from a shuffled permutation (scattered, non-contiguous); freed blocks go back
to the pool and are reused dirty. Sequences can start late (staggered), split their prompt into
chunks across steps, fork (sharing blocks, with copy-on-write on the shared partial block) and be
swapped out to host blocks and back in to different device blocks. A sequence may carry sampling
options; the driver fills in the per-step fields (prompt/output ids, the generator key) as the
engine will.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from asyncpaged.sampling.options import SamplingOptions, derive_generator_key
from asyncpaged.worker.protocol import SampledToken, SequenceStep, StepPlan
from asyncpaged.worker.runner import ModelRunner


@dataclass
class SimSequence:
    seq_id: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    start_step: int = 0
    chunk_sizes: tuple[int, ...] = ()  # prompt chunks; () = the whole prompt at once
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    chunk_index: int = 0
    host_blocks: list[int] | None = None  # set while swapped out
    sampling: SamplingOptions | None = None  # None = greedy
    sampled: list[SampledToken] = field(default_factory=list)

    def step_sampling(self) -> SamplingOptions | None:
        """This step's options: token lists for penalties, a key from (seed, 0, num generated)."""
        if self.sampling is None:
            return None
        seed = self.sampling.seed
        return replace(
            self.sampling,
            prompt_token_ids=self.prompt,
            output_token_ids=tuple(self.output),
            generator_key=0 if seed is None else derive_generator_key(seed, 0, len(self.output)),
        )

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    @property
    def is_finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class Driver:
    def __init__(self, runner: ModelRunner, *, seed: int = 0, want_logprob: bool = True) -> None:
        self.runner = runner
        self.want_logprob = want_logprob  # False: plain greedy rows (the screened LM head path)
        self.block_size = runner.block_size
        rng = random.Random(seed)
        self.free = list(range(runner.kv_cache.num_blocks))
        rng.shuffle(self.free)
        self.free_host = list(range(runner.host_kv_cache.num_blocks))
        rng.shuffle(self.free_host)
        self.refcount: dict[int, int] = {}
        self.step_index = 0

    def _allocate(self) -> int:
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                del self.refcount[block]
                self.free.insert(0, block)  # reused later, dirty

    def _schedule(self, seq: SimSequence, copies: list[tuple[int, int]]) -> SequenceStep:
        if seq.num_computed < len(seq.prompt):
            if seq.chunk_sizes:
                n = seq.chunk_sizes[seq.chunk_index]
                seq.chunk_index += 1
            else:
                n = len(seq.prompt) - seq.num_computed
            new = seq.prompt[seq.num_computed : seq.num_computed + n]
            do_sample = seq.num_computed + n == len(seq.prompt)
        else:
            new, do_sample = (seq.output[-1],), True
        start, end = seq.num_computed, seq.num_computed + len(new)
        first_block = start // self.block_size
        if first_block < len(seq.blocks) and self.refcount[seq.blocks[first_block]] > 1:
            fresh = self._allocate()  # copy-on-write of the shared partial block
            copies.append((seq.blocks[first_block], fresh))
            self._release([seq.blocks[first_block]])
            seq.blocks[first_block] = fresh
        while len(seq.blocks) * self.block_size < end:
            seq.blocks.append(self._allocate())
        bs = self.block_size
        slots = tuple(seq.blocks[p // bs] * bs + p % bs for p in range(start, end))
        return SequenceStep(
            seq_id=seq.seq_id,
            token_ids=tuple(new),
            num_computed_tokens=start,
            slot_mapping=slots,
            block_table=tuple(seq.blocks),
            do_sample=do_sample,
            want_logprob=self.want_logprob,
            sampling=seq.step_sampling() if do_sample else None,
        )

    def step(self, seqs: list[SimSequence]) -> None:
        """Schedule every started, unfinished, resident sequence for one step and execute it."""
        copies: list[tuple[int, int]] = []
        chosen = [
            s
            for s in seqs
            if s.start_step <= self.step_index and not s.is_finished and s.host_blocks is None
        ]
        steps = tuple(self._schedule(s, copies) for s in chosen)
        result = self.runner.execute(StepPlan(seqs=steps, copy_pairs=tuple(copies)))
        by_id = {s.seq_id: s for s in chosen}
        for st in steps:
            by_id[st.seq_id].num_computed += len(st.token_ids)
        for sampled in result.sampled:
            seq = by_id[sampled.seq_id]
            seq.output.append(sampled.token_id)
            seq.sampled.append(sampled)
            if self.want_logprob:
                assert sampled.logprob is not None
                seq.logprobs.append(sampled.logprob)
        assert {s.seq_id for s in result.sampled} == {st.seq_id for st in steps if st.do_sample}
        for seq in chosen:
            if seq.is_finished:
                self._release(seq.blocks)
                seq.blocks = []
        self.step_index += 1

    def run(self, seqs: list[SimSequence], max_steps: int = 1000) -> None:
        while not all(s.is_finished for s in seqs):
            assert self.step_index < max_steps, "generation did not finish"
            self.step(seqs)

    def fork(self, parent: SimSequence, seq_id: int) -> SimSequence:
        """A child sharing every block of ``parent`` (refcounts up), as after parallel sampling."""
        for block in parent.blocks:
            self.refcount[block] += 1
        return SimSequence(
            seq_id=seq_id,
            prompt=parent.prompt,
            max_new_tokens=parent.max_new_tokens,
            blocks=list(parent.blocks),
            num_computed=parent.num_computed,
            output=list(parent.output),
            logprobs=list(parent.logprobs),
            chunk_index=parent.chunk_index,
            chunk_sizes=parent.chunk_sizes,
            sampling=parent.sampling,
            sampled=list(parent.sampled),
        )

    def swap_out(self, seq: SimSequence) -> None:
        host = [self.free_host.pop() for _ in seq.blocks]
        self.runner.swap_out(tuple(zip(seq.blocks, host, strict=True)))
        self._release(seq.blocks)
        seq.blocks, seq.host_blocks = [], host

    def swap_in(self, seq: SimSequence) -> None:
        assert seq.host_blocks is not None
        device = [self._allocate() for _ in seq.host_blocks]
        self.runner.swap_in(tuple(zip(seq.host_blocks, device, strict=True)))
        self.free_host.extend(seq.host_blocks)
        seq.blocks, seq.host_blocks = device, None
