"""ModelInstance: the one loaded model + KV caches + decode graphs that the runner and the draft
model each hold; ``ModelRunner.from_spec``, the one way the engine builds a runner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from asyncpaged import default_model
from asyncpaged.model.attention_select import select_attention_backend
from asyncpaged.worker.draft import DraftModel
from asyncpaged.worker.instance import ModelInstance
from asyncpaged.worker.runner import ModelRunner, WorkerSpec
from tests.model.driver import Driver, SimSequence


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


def test_from_spec_builds_what_the_constructor_builds() -> None:
    """``ModelRunner.from_spec`` (the engine's thread, the runner's process and every
    tensor-parallel rank build from a ``WorkerSpec``) gives the runner the long constructor
    call gave: the same caches, LM-head levers and tokens, on the built-in model."""
    path = default_model.path()
    spec = WorkerSpec(model=str(path), dtype="float32", kv_cache_dtype="float32",
                      num_device_blocks=24, num_host_blocks=4, block_size=16, device_type="cpu",
                      attention_backend="auto", packed_linears=True, seed=7,
                      num_threads=torch.get_num_threads(), screened_lm_head=False)  # fmt: skip
    built = ModelRunner.from_spec(spec, "cpu")
    direct = ModelRunner(path, torch.float32, 24, 16, 4, device="cpu",
                         attn_backend=select_attention_backend("cpu", "auto"), seed=7,
                         kv_cache_dtype=torch.float32, packed_linears=True,
                         screened_lm_head=False)  # fmt: skip
    for a, b in ((built.kv_cache, direct.kv_cache), (built.host_kv_cache, direct.host_kv_cache)):
        assert (a.key.shape, a.value.shape, a.dtype, a.layout) == (
            b.key.shape, b.value.shape, b.dtype, b.layout,
        )  # fmt: skip
    assert type(built.model.attn_backend) is type(direct.model.attn_backend)
    assert built.bf16_screen == direct.bf16_screen
    assert (built.screened_head is None) == (direct.screened_head is None)
    assert (built.int8_head is None) == (direct.int8_head is None)
    assert (built.model.packed_lm_head is None) == (direct.model.packed_lm_head is None)
    assert (built.model.fused_ops is None) == (direct.model.fused_ops is None)
    assert torch.equal(built.generator.get_state(), direct.generator.get_state())
    outputs = []
    for runner in (built, direct):
        seqs = [SimSequence(seq_id=i, prompt=tuple(range(20 + 9 * i, 31 + 13 * i)),
                            max_new_tokens=5 + i) for i in range(3)]  # fmt: skip
        Driver(runner, seed=3, want_logprob=False).run(seqs)
        outputs.append([s.output for s in seqs])
    assert outputs[0] == outputs[1]
