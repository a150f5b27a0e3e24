"""Every model family, split into N shards, generates what transformers generates.

The shards run in threads of this process, summed by an in-process all-reduce (a barrier and a
fixed summation order) instead of torch.distributed: this checks the sharding itself (column and
row splits, GPT-2's fused q|k|v, row-parallel biases on rank 0 only, sliced loading, packed
linears on shards, the wire form of a step) on every family in about a second each, while the
engine tests check the processes and collectives. The schedule is the model tests' realistic one:
staggered starts, chunked prefills, dirty reused blocks, a NaN-poisoned cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from asyncpaged.config import KVShape
from asyncpaged.distributed.commands import RunStep
from asyncpaged.model.base import TensorShard
from asyncpaged.model.loader import load_config
from asyncpaged.worker.protocol import LateDelivery, StepPlan, StepResult
from asyncpaged.worker.runner import ModelRunner
from tests.model.driver import Driver
from tests.model.reference import HFReference
from tests.model.test_generate_equality import FAMILIES, _assert_matches, _make_sequences


class _ThreadAllReduce:
    """Sums one tensor per rank; every rank gets the same sum, in rank order."""

    def __init__(self, world_size: int) -> None:
        self._parts: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=30)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], None]:
        def all_reduce(tensor: torch.Tensor) -> None:
            self._parts[rank] = tensor.clone()
            self._barrier.wait()
            parts = [p for p in self._parts if p is not None]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            self._barrier.wait()  # everyone has read the parts before any is overwritten
            tensor.copy_(total)

        return all_reduce


class ThreadedShards:
    """A ``ModelRunner`` look-alike for the test driver: N shards stepping together."""

    def __init__(self, path: Path, world_size: int) -> None:
        reduce = _ThreadAllReduce(world_size)
        self.runners = [
            ModelRunner(path, "float32", num_blocks=64, block_size=16, num_host_blocks=16,
                        kv_fill_value=float("nan"),
                        shard=TensorShard(rank=rank, world_size=world_size,
                                          all_reduce=reduce.for_rank(rank)))
            for rank in range(world_size)
        ]  # fmt: skip
        first = self.runners[0]
        self.block_size, self.kv_cache, self.host_kv_cache = (
            first.block_size, first.kv_cache, first.host_kv_cache
        )  # fmt: skip
        self._pool = ThreadPoolExecutor(world_size - 1)

    def execute(self, plan: StepPlan) -> StepResult:
        wire = RunStep.of(plan, dict).plan()  # what a worker receives: nothing to sample
        others = [self._pool.submit(r.execute_forward, wire) for r in self.runners[1:]]
        result = self.runners[0].execute(plan)
        for future in others:
            future.result()
        return result

    def put_late_inputs(self, delivery: LateDelivery) -> None:
        self.runners[0].put_late_inputs(delivery)

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        for runner in self.runners:
            runner.swap_out(pairs)

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        for runner in self.runners:
            runner.swap_in(pairs)


@pytest.mark.parametrize(
    ("name", "world_size"),
    [*((f, 2) for f in FAMILIES), ("phi3-swa", 2), ("llama-mha", 4), ("opt", 4),
     ("llama-gqa", 4), ("gemma3", 2), ("qwen3-sliding-tied", 2)],  # KV heads replicated
)  # fmt: skip
def test_sharded_greedy_matches_transformers(
    name: str,
    world_size: int,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    path = tiny_checkpoint(name)
    shards = ThreadedShards(path, world_size)
    config = load_config(path)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_rank = kv_heads // world_size or 1  # (fewer KV heads than ranks: one each, replicated)
    assert [r.model.num_kv_heads for r in shards.runners] == [per_rank] * world_size
    assert KVShape.from_hf_config(config, 4, world_size).num_kv_heads == per_rank
    seqs = _make_sequences(seed=1)
    Driver(shards, seed=7).run(seqs)  # type: ignore[arg-type]
    _assert_matches(seqs, hf_reference(name))


def test_shards_hold_their_slices_packed(tiny_checkpoint: Callable[[str], Path]) -> None:
    from asyncpaged.model.packed_linear import PACKED_ATTR, packing_supported

    shards = ThreadedShards(tiny_checkpoint("opt"), 2)
    first, second = (r.model.model.decoder.layers[0] for r in shards.runners)  # type: ignore[union-attr]
    assert first.fc2.bias is not None and second.fc2.bias is None  # row-parallel: rank 0 only
    assert first.fc1.bias.shape == second.fc1.bias.shape == (64,)  # ffn_dim 128 / 2
    assert not torch.equal(first.fc1.bias, second.fc1.bias)  # different slices
    if packing_supported():  # the oneDNN packed weights are the shards' own
        assert PACKED_ATTR in first.fc1.__dict__ and PACKED_ATTR in second.fc2.__dict__


def test_the_wire_step_keeps_what_every_rank_reads() -> None:
    """A worker's forward reads a row's tokens, context, slots, table and RoPE length: the
    wire form keeps each of them (a placeholder replaced by what rank 0 sampled), and the
    rows sample nothing there."""
    from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN
    from asyncpaged.worker.protocol import SequenceStep

    seqs = (
        SequenceStep(seq_id=3, token_ids=(5, 6, 7), num_computed_tokens=18,
                     slot_mapping=(50, 51, 52), block_table=(9, 2), do_sample=True,
                     min_rope_len=21, table_start=1),
        SequenceStep(seq_id=8, token_ids=(PLACEHOLDER_TOKEN,), num_computed_tokens=4,
                     slot_mapping=(68,), block_table=(4,), do_sample=True, want_logprob=True),
    )  # fmt: skip
    wire = RunStep.of(StepPlan(seqs=seqs, copy_pairs=((1, 2),)), lambda: {8: 77}).plan()
    assert wire.copy_pairs == ((1, 2),)
    fields = ("seq_id", "num_computed_tokens", "slot_mapping", "block_table", "table_start",
              "min_rope_len")  # fmt: skip
    for got, want in zip(wire.seqs, seqs, strict=True):
        assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
        assert not got.do_sample and not got.want_logprob and got.sampling is None
    assert [s.token_ids for s in wire.seqs] == [(5, 6, 7), (77,)]
