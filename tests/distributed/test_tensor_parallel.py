"""Tensor parallelism (TP=2 over gloo on CPU) against TP=1 and transformers, token for token.

Each model runs one workload on a TP=1 engine and on a TP=2 engine (one spawned worker): 12
requests of mixed lengths in a small device pool, so steps mix prefill chunks with decodes and
the scheduler preempts both by swap (host pool of 3 blocks) and, when the host pool cannot take a
request, by recompute. The engines are shared by the tests of a model (module-scoped runs).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import (
    AsyncEngine,
    EngineConfig,
    SamplingParams,
    SpeculativeConfig,
    StructuredOutputsParams,
)
from asyncpaged.model.errors import UnsupportedModelError
from tests.distributed.conftest import EngineRun, host_bytes, make_prompts, run_engine
from tests.engine.test_structured_outputs import SCHEMA
from tests.model.reference import HFReference

MODELS = ["llama-gqa", "opt"]  # Llama family with GQA (4 heads, 2 KV heads); OPT (4 heads)
MAX_TOKENS = 24
NUM_DEVICE_BLOCKS = 24
NUM_HOST_BLOCKS = 3


@pytest.fixture(scope="module", params=MODELS)
def runs(
    request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path]
) -> tuple[str, EngineRun, EngineRun]:
    """(model, TP=1 run, TP=2 run) of the same workload with the same pool sizes in blocks."""
    name: str = request.param
    path = tiny_checkpoint(name)
    prompts = make_prompts(12, seed=0)
    common = {"num_device_blocks": NUM_DEVICE_BLOCKS, "preemption_mode": "swap",
              "max_num_batched_tokens": 64}  # fmt: skip
    tp1 = run_engine(path, prompts, MAX_TOKENS, **common,
                     swap_space_bytes=host_bytes(path, NUM_HOST_BLOCKS, 1))  # fmt: skip
    tp2 = run_engine(path, prompts, MAX_TOKENS, **common, tensor_parallel_size=2,
                     swap_space_bytes=host_bytes(path, NUM_HOST_BLOCKS, 2))  # fmt: skip
    return name, tp1, tp2


def test_tp2_tokens_equal_tp1_with_mixed_steps_swap_and_recompute(
    runs: tuple[str, EngineRun, EngineRun],
) -> None:
    name, tp1, tp2 = runs
    # The workload exercised what it claims to on both engines. The exact preemption counts
    # depend on timing (when concurrent submissions reach the scheduler, when a swap's copy
    # completes), so they may differ between the runs; greedy tokens may not.
    for run in (tp1, tp2):
        assert run.num_mixed_steps > 0 and run.num_swap_outs > 0 and run.num_recomputes > 0, run
    for one, two in zip(tp1.outputs, tp2.outputs, strict=True):
        assert one.prompt_token_ids == two.prompt_token_ids
        assert two.outputs[0].token_ids == one.outputs[0].token_ids, (name, one.prompt_token_ids)
        assert len(two.outputs[0].token_ids) == MAX_TOKENS


def test_tp2_tokens_equal_transformers(
    runs: tuple[str, EngineRun, EngineRun], hf_reference: Callable[[str], HFReference]
) -> None:
    name, _, tp2 = runs
    ref = hf_reference(name)
    for out in tp2.outputs:
        want, _ = ref.generate(tuple(out.prompt_token_ids), MAX_TOKENS)
        assert out.outputs[0].token_ids == want, (name, out.prompt_token_ids)


def test_blocks_are_free_when_the_last_request_returns(
    runs: tuple[str, EngineRun, EngineRun],
) -> None:
    _, tp1, tp2 = runs
    for run in (tp1, tp2):
        free, total = run.blocks_at_return
        assert free == total == NUM_DEVICE_BLOCKS, run.blocks_at_return


def test_per_rank_kv_memory_is_half(runs: tuple[str, EngineRun, EngineRun]) -> None:
    _, tp1, tp2 = runs
    (kv_bytes,) = tp1.kv_cache_bytes  # the same number of blocks on every engine and rank
    assert tp2.kv_cache_bytes == [kv_bytes // 2, kv_bytes // 2]
    assert tp2.num_kv_heads == [tp1.num_kv_heads[0] // 2] * 2


def test_shutdown_joins_every_rank(runs: tuple[str, EngineRun, EngineRun]) -> None:
    _, _, tp2 = runs
    assert tp2.worker_exitcodes == [0]  # told to shut down, exited cleanly, joined
    assert len(tp2.worker_pids) == 1
    for pid in tp2.worker_pids:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} left as a zombie or alive"


@pytest.mark.parametrize(("name", "size"), [("llama-gqa", 3), ("opt", 3)])
def test_indivisible_heads_are_refused_before_any_process_starts(
    name: str, size: int, tiny_checkpoint: Callable[[str], Path]
) -> None:
    import multiprocessing

    config = EngineConfig(model=str(tiny_checkpoint(name)), tensor_parallel_size=size)

    async def main() -> None:
        async with AsyncEngine(config):
            pass

    with pytest.raises(UnsupportedModelError, match=f"tensor_parallel_size={size} must divide"):
        anyio.run(main)
    assert not multiprocessing.active_children()


def test_moe_expert_width_is_checked_before_any_process_starts() -> None:
    from types import SimpleNamespace

    from asyncpaged.distributed import check_tensor_parallel

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                             hidden_size=64, moe_intermediate_size=30)  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"moe_intermediate_size \(30\)"):
        check_tensor_parallel(config, 4)
    check_tensor_parallel(config, 2)


def test_kv_heads_fewer_than_the_ranks_replicate_by_whole_factors() -> None:
    from types import SimpleNamespace

    from asyncpaged.config import KVShape, kv_head_replicas
    from asyncpaged.distributed import check_tensor_parallel

    assert kv_head_replicas(8, 2) == (4, 1)
    assert kv_head_replicas(2, 4) == (1, 2)  # each head on two ranks
    assert kv_head_replicas(1, 4) == (1, 4)
    config = SimpleNamespace(num_attention_heads=12, num_key_value_heads=3, intermediate_size=96,
                             hidden_size=48, num_hidden_layers=2)  # fmt: skip
    check_tensor_parallel(config, 6)  # 3 KV heads on 6 ranks: each held twice
    assert KVShape.from_hf_config(config, 4, 6).num_kv_heads == 1
    with pytest.raises(UnsupportedModelError, match=r"num_key_value_heads \(3\)"):
        check_tensor_parallel(config, 4)  # neither a share nor a whole factor


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_speculative_decoding_is_exact(
    async_scheduling: bool,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Prompt lookup under TP=2: rank 0 verifies, the other rank runs the same k + 1 rows;
    with async scheduling the steps between proposals go ahead (rank 0 sends the late
    tokens)."""
    path, ref = tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa")
    spans = [tuple(range(40 + 7 * i, 46 + 7 * i)) for i in range(4)]
    prompts = [span * 4 for span in spans]  # repeated spans: the n-gram lookup proposes
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3)  # fmt: skip
    run = run_engine(path, prompts, MAX_TOKENS, tensor_parallel_size=2, speculative_config=spec,
                     async_scheduling=async_scheduling)  # fmt: skip
    for prompt, out in zip(prompts, run.outputs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, MAX_TOKENS)[0], prompt
    assert run.blocks_at_return[0] == run.blocks_at_return[1]
    assert run.num_draft_tokens > 0
    assert (run.num_steps_planned_ahead > 0) == async_scheduling, run


def test_tp2_with_async_scheduling_gives_the_same_tokens(
    runs: tuple[str, EngineRun, EngineRun],
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """TP=2 with steps planned ahead: rank 0 puts the token it sampled last into the other
    rank's rows that have a placeholder. Greedy tokens equal TP=1's and transformers', under
    swap and recompute preemption too (a plan waits while anything is swapped)."""
    name, tp1, _ = runs
    path = tiny_checkpoint(name)
    run = run_engine(path, make_prompts(12, seed=0), MAX_TOKENS, tensor_parallel_size=2,
                     async_scheduling=True, num_device_blocks=NUM_DEVICE_BLOCKS,
                     preemption_mode="swap", max_num_batched_tokens=64,
                     swap_space_bytes=host_bytes(path, NUM_HOST_BLOCKS, 2))  # fmt: skip
    assert run.num_steps_planned_ahead > 0, run
    for one, two in zip(tp1.outputs, run.outputs, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids, (name, one.prompt_token_ids)
    ref = hf_reference(name)
    for out in run.outputs[:3]:
        assert out.outputs[0].token_ids == ref.generate(tuple(out.prompt_token_ids), MAX_TOKENS)[0]


def test_tp2_plans_grammar_requests_ahead_with_the_same_tokens(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Structured outputs under TP=2 with steps planned ahead: rank 0's runner takes the late
    bitmasks (``late_inputs``); jump-forward voids samples planned ahead. Seeded sampled JSON
    equals TP=1's without async scheduling."""
    path = tiny_checkpoint("llama-gqa")
    prompts = make_prompts(6, seed=5)
    json = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=48, structured_outputs=json)
    one = run_engine(path, prompts, 48, params, async_scheduling=False)
    two = run_engine(path, prompts, 48, params, tensor_parallel_size=2, async_scheduling=True)
    assert two.num_steps_planned_ahead > 0, two
    for a, b in zip(one.outputs, two.outputs, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, a.prompt_token_ids


@pytest.mark.parametrize(("name", "kv_heads"), [("phi3-longrope", [2, 2]), ("phi4-mini", [1, 1])])
def test_tp2_phi3_longrope_ranks_rotate_with_the_same_factors(
    name: str,
    kv_heads: list[int],
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    """Phi-3 (fused q|k|v of unequal parts, split part by part) with longrope (switch at 20
    tokens) under TP=2: a long prompt's first chunks and a restarted request's recompute
    rotate with the long factors on every rank (the wire step carries the RoPE length the
    scheduler set), so the tokens are transformers'. phi4-mini (partial rotary, tied
    embeddings) has one KV head: both ranks hold it."""
    path, ref = tiny_checkpoint(name), hf_reference(name)
    base = tuple(range(40, 70))
    prompts = [base[:30], base[:17], base[:24], base[:12]]
    run = run_engine(path, prompts, 10, tensor_parallel_size=2, max_num_batched_tokens=8)
    for prompt, out in zip(prompts, run.outputs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], len(prompt)
    assert run.num_kv_heads == kv_heads  # per rank: half of phi3's 4, phi4-mini's 1 on both


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_draft_model_runs_whole_on_rank_0(
    async_scheduling: bool,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    perturbed_draft: Callable[[str], Path],
) -> None:
    """A draft model under TP=2: it runs whole on rank 0 after the target's sharded step and
    proposes there; the other rank runs the target's rows, proposals included. Greedy tokens
    are transformers', under swap preemption (the draft's blocks go with rank 0's), with the
    draft both keeping and losing proposals."""
    path, ref = tiny_checkpoint("llama-gqa"), hf_reference("llama-gqa")
    prompts = make_prompts(12, seed=0)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=3,
                             model=str(perturbed_draft("llama-gqa")))  # fmt: skip
    run = run_engine(path, prompts, MAX_TOKENS, tensor_parallel_size=2, speculative_config=spec,
                     async_scheduling=async_scheduling, num_device_blocks=NUM_DEVICE_BLOCKS,
                     preemption_mode="swap", max_num_batched_tokens=64,
                     swap_space_bytes=host_bytes(path, NUM_HOST_BLOCKS, 2))  # fmt: skip
    for prompt, out in zip(prompts, run.outputs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, MAX_TOKENS)[0], prompt
    assert 0 < run.num_accepted_tokens < run.num_draft_tokens, run
    assert run.num_swap_outs > 0, run
    assert (run.num_steps_planned_ahead > 0) == async_scheduling, run
    assert run.blocks_at_return[0] == run.blocks_at_return[1]


def test_tp2_int8_cache_shards_codes_and_scales(tiny_checkpoint: Callable[[str], Path]) -> None:
    """An int8 KV cache under TP=2: each rank quantizes its own KV heads (a scale per token and
    head needs no other rank's values); the tokens are the rounding reference's."""
    from asyncpaged.model.kv_quant import KV_QUANT_DTYPES
    from tests.model.reference import RoundedKVReference

    path = tiny_checkpoint("llama-gqa")
    prompts = make_prompts(6, seed=3)
    run = run_engine(path, prompts, 12, num_device_blocks=12, preemption_mode="swap",
                     kv_cache_dtype="int8", tensor_parallel_size=2,
                     swap_space_bytes=1 << 16)  # fmt: skip
    ref = RoundedKVReference(path, KV_QUANT_DTYPES["int8"])
    for out in run.outputs:
        want, _ = ref.generate(tuple(out.prompt_token_ids), 12)
        assert out.outputs[0].token_ids == want, out.prompt_token_ids
    assert run.num_swap_outs > 0
