"""ModelRunner behaviour outside the token-equality tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncpaged.testing.tiny_models import VOCAB_SIZE
from asyncpaged.worker.protocol import SequenceStep, StepPlan
from asyncpaged.worker.runner import ModelRunner


def _prefill(
    seq_id: int, prompt: tuple[int, ...], blocks: tuple[int, ...], **kw: bool
) -> SequenceStep:
    slots = tuple(blocks[p // 16] * 16 + p % 16 for p in range(len(prompt)))
    return SequenceStep(
        seq_id=seq_id,
        token_ids=prompt,
        num_computed_tokens=0,
        slot_mapping=slots,
        block_table=blocks,
        do_sample=kw.get("do_sample", True),
        want_logprob=kw.get("want_logprob", False),
    )


def test_bfloat16_runner_runs_with_a_bfloat16_cache(tiny_checkpoint: Callable[[str], Path]) -> None:
    runner = ModelRunner(tiny_checkpoint("llama-gqa"), "bfloat16", num_blocks=8, num_host_blocks=2)
    assert runner.kv_cache.dtype == torch.bfloat16
    assert runner.host_kv_cache.dtype == torch.bfloat16
    result = runner.execute(
        StepPlan(seqs=(_prefill(1, tuple(range(4, 24)), (5, 2), want_logprob=True),))
    )
    (sampled,) = result.sampled
    assert 0 <= sampled.token_id < VOCAB_SIZE
    assert sampled.logprob is not None
    assert sampled.logprob <= 0.0


def test_only_sampling_sequences_return_tokens_and_logprobs_only_when_asked(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    runner = ModelRunner(tiny_checkpoint("gpt2"), "float32", num_blocks=8)
    plan = StepPlan(
        seqs=(
            _prefill(1, (5, 6, 7), (0,), do_sample=False),  # a chunk short of the prompt's end
            _prefill(2, (8, 9), (3,)),
            _prefill(3, (10, 11, 12, 13), (1,), want_logprob=True),
        )
    )
    result = runner.execute(plan)
    assert [s.seq_id for s in result.sampled] == [2, 3]
    assert result.sampled[0].logprob is None
    assert result.sampled[1].logprob is not None


def test_plan_with_only_copies_runs_them(tiny_checkpoint: Callable[[str], Path]) -> None:
    runner = ModelRunner(
        tiny_checkpoint("opt"), "float32", num_blocks=4, kv_fill_value=float("nan")
    )
    runner.kv_cache.key[:, 1] = 3.0
    runner.kv_cache.value[:, 1] = 4.0
    assert runner.execute(StepPlan(seqs=(), copy_pairs=((1, 2),))).sampled == ()
    assert bool((runner.kv_cache.key[:, 2] == 3.0).all())
    assert bool((runner.kv_cache.value[:, 2] == 4.0).all())
    assert bool(runner.kv_cache.key[:, 3].isnan().all())


def test_inconsistent_plan_is_an_assertion(tiny_checkpoint: Callable[[str], Path]) -> None:
    runner = ModelRunner(tiny_checkpoint("gpt2"), "float32", num_blocks=8)
    ok = _prefill(1, tuple(range(4, 24)), (0, 1))  # 20 tokens need two blocks of 16
    too_few_blocks = SequenceStep(
        seq_id=1,
        token_ids=ok.token_ids,
        num_computed_tokens=0,
        slot_mapping=ok.slot_mapping,
        block_table=(0,),
        do_sample=True,
    )
    with pytest.raises(AssertionError, match="cannot hold 20 tokens"):
        runner.execute(StepPlan(seqs=(too_few_blocks,)))


def test_invalid_cache_sizes_are_rejected(tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="num_blocks and block_size must be > 0"):
        ModelRunner(tiny_checkpoint("gpt2"), "float32", num_blocks=0)
