"""ModelInstance: the one loaded model + KV caches + decode graphs that the runner and the draft
model each hold."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from asyncpaged.worker.draft import DraftModel
from asyncpaged.worker.instance import ModelInstance
from asyncpaged.worker.runner import ModelRunner


def test_the_runner_and_the_draft_hold_one_instance_each(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("llama-gqa")
    runner = ModelRunner(path, "float32", num_blocks=8, num_host_blocks=4)
    draft = DraftModel(path, dtype=torch.float32, device=torch.device("cpu"), num_blocks=8,
                       block_size=16, num_host_blocks=4, max_num_seqs=2,
                       num_speculative_tokens=3)  # fmt: skip
    for holder in (runner, draft):
        assert isinstance(holder.instance, ModelInstance)
        assert holder.model is holder.instance.model
        assert holder.kv_cache is holder.instance.kv_cache
        assert holder.host_kv_cache is holder.instance.host_kv_cache
        assert holder.host_kv_cache.num_blocks == 4
        assert holder.graphs is None
    assert runner.kv_cache.num_blocks == 8
    # the draft's device cache: the target's block ids, then its scratch blocks
    assert draft.num_scratch_blocks == 2 * (3 // 16 + 2)
    assert draft.kv_cache.num_blocks == 8 + draft.num_scratch_blocks
    runner.attach_draft(draft)  # the layouts agree


def test_swaps_and_copies_move_whole_blocks(tiny_checkpoint: Callable[[str], Path]) -> None:
    instance = ModelInstance(tiny_checkpoint("llama-gqa"), "float32", torch.device("cpu"),
                             num_blocks=6, block_size=16, num_host_blocks=3,
                             kv_fill_value=0.0)  # fmt: skip
    cache, host = instance.kv_cache, instance.host_kv_cache
    assert (cache.layout, cache.dtype) == (host.layout, host.dtype)
    for t in (cache.key, cache.value):
        t[:, 1] = 1.0
        t[:, 2] = 2.0
    instance.copy_blocks([(1, 4)])
    instance.swap_out(((2, 0), (4, 1)))
    instance.swap_in(((0, 5), (1, 3)))
    for t in (cache.key, cache.value):
        assert bool((t[:, 4] == 1.0).all()) and bool((t[:, 3] == 1.0).all())
        assert bool((t[:, 5] == 2.0).all()) and bool((t[:, 0] == 0.0).all())
