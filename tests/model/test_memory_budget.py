"""The KV cache's share of a CUDA device (``gpu_memory_utilization``), planned on any machine:
the device's size is the one thing read from CUDA, and the tests set it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoConfig, AutoModelForCausalLM

from asyncpaged import EngineConfig, InvalidRequestError, SpeculativeConfig
from asyncpaged.config import DEFAULT_KV_CACHE_BYTES, KVShape
from asyncpaged.engine.build import plan_model
from asyncpaged.memory_budget import (
    CONTEXT_RESERVE_BYTES,
    activation_reserve_bytes,
    checkpoint_weight_bytes,
    cuda_memory,
)

GIB = 2**30


def _resolve_here(model: str, revision: str | None) -> Path:
    del revision
    return Path(model)


@pytest.fixture
def device_gib(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    def set_size(gib: float) -> None:
        monkeypatch.setattr("asyncpaged.memory_budget.cuda_device_bytes", lambda d: int(gib * GIB))

    return set_size


def test_weights_are_counted_at_the_dtype_they_load_in(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("llama-gqa")  # saved in float32
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())  # tied weights once, as stored
    assert checkpoint_weight_bytes(path, torch.float32) == 4 * params
    assert checkpoint_weight_bytes(path, torch.bfloat16) == 2 * params
    # two ranks: the embeddings, the norms and the LM head whole on each, the layers halved
    whole = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    whole |= {n for n, _ in model.named_parameters() if n.endswith("layernorm.weight")}
    names = dict(model.named_parameters())
    kept = sum(names[n].numel() for n in whole if n in names)
    assert checkpoint_weight_bytes(path, torch.float32, 2) == 4 * kept + 4 * (params - kept) // 2


def test_the_reserve_covers_a_steps_widest_tensors_and_the_sampling_rows() -> None:
    config = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000,
    )  # fmt: skip
    # per token, float32: 4 x 64 hidden + 3 x 128 MLP + (4 + 2 x 2) heads x 16 = 768 floats;
    # logits: min(100 tokens, 8 rows) x 1000 x 20 bytes
    want = 2 * (100 * 768 * 4 + 8 * 1000 * 20) + CONTEXT_RESERVE_BYTES
    assert activation_reserve_bytes(config, batched_tokens=100, sampling_rows=8) == want


def test_cuda_gives_the_kv_cache_what_the_utilization_leaves(
    tiny_checkpoint: Callable[[str], Path], device_gib: Callable[[float], None]
) -> None:
    path = tiny_checkpoint("llama-gqa")
    hf_config = AutoConfig.from_pretrained(str(path))
    device_gib(4.0)
    cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", max_model_len=256)
    memory = cuda_memory(cfg, path, _resolve_here)
    assert memory is not None
    with capture_logs() as logs:
        plan = plan_model(cfg, hf_config, memory)
    weights = checkpoint_weight_bytes(path, torch.float32)
    reserve = activation_reserve_bytes(
        hf_config, batched_tokens=cfg.max_num_batched_tokens, sampling_rows=cfg.max_num_seqs
    )
    per_block = KVShape.from_hf_config(hf_config, 4).block_bytes(16)
    kv = int(0.9 * 4 * GIB) - weights - reserve
    assert plan.num_device_blocks == kv // per_block
    assert plan.num_device_blocks * per_block > 10 * DEFAULT_KV_CACHE_BYTES  # not the CPU's 256 MiB
    (event,) = [e for e in logs if e["event"] == "kv_budget"]
    assert event["blocks"] == plan.num_device_blocks and event["utilization"] == 0.9
    half = plan_model(dataclasses.replace(cfg, gpu_memory_utilization=0.5), hf_config, memory)
    assert half.num_device_blocks == (int(0.5 * 4 * GIB) - weights - reserve) // per_block


def test_a_draft_models_weights_and_cache_share_the_budget(
    tiny_checkpoint: Callable[[str], Path], device_gib: Callable[[float], None]
) -> None:
    path, draft = tiny_checkpoint("llama-gqa"), tiny_checkpoint("llama-mha")
    hf_config = AutoConfig.from_pretrained(str(path))
    device_gib(4.0)
    spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3)
    cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", max_model_len=256,
                       speculative_config=spec)  # fmt: skip
    memory = cuda_memory(cfg, path, _resolve_here)
    assert memory is not None and memory.draft_path == draft
    plan = plan_model(cfg, hf_config, memory)
    weights = checkpoint_weight_bytes(path, torch.float32) + checkpoint_weight_bytes(
        draft, torch.float32
    )
    reserve = activation_reserve_bytes(
        hf_config, batched_tokens=cfg.max_num_batched_tokens, sampling_rows=cfg.max_num_seqs * 4
    )
    draft_block = KVShape.from_hf_config(AutoConfig.from_pretrained(str(draft)), 4).block_bytes(16)
    per_block = KVShape.from_hf_config(hf_config, 4).block_bytes(16) + draft_block
    assert plan.num_device_blocks == (int(0.9 * 4 * GIB) - weights - reserve) // per_block


def test_a_configured_size_or_a_cpu_skips_the_budget(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("llama-gqa")
    for cfg in (
        EngineConfig(model=str(path), device="cpu"),
        EngineConfig(model=str(path), device="cuda", kv_cache_bytes=1 << 20),
        EngineConfig(model=str(path), device="cuda:1", num_device_blocks=7),
    ):
        assert cuda_memory(cfg, path, _resolve_here) is None
    hf_config = AutoConfig.from_pretrained(str(path))
    plan = plan_model(
        EngineConfig(model=str(path), device="cuda:1", num_device_blocks=7), hf_config
    )
    assert plan.num_device_blocks == 7


def test_a_device_too_small_for_one_sequence_is_refused_with_the_knobs(
    tiny_checkpoint: Callable[[str], Path], device_gib: Callable[[float], None]
) -> None:
    path = tiny_checkpoint("llama-gqa")
    hf_config = AutoConfig.from_pretrained(str(path))
    device_gib(1.1)  # 0.9 x 1.1 GiB is below the 1 GiB context reserve alone
    cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", max_model_len=256)
    memory = cuda_memory(cfg, path, _resolve_here)
    assert memory is not None
    with pytest.raises(InvalidRequestError, match=r"max_model_len.*gpu_memory_utilization"):
        plan_model(cfg, hf_config, memory)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01])
def test_the_utilization_must_be_a_share(bad: float) -> None:
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        EngineConfig(model="m", gpu_memory_utilization=bad)


def test_a_cache_that_does_not_fit_is_a_typed_error_naming_the_knobs(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget is an estimate (and another process may hold memory): an out-of-memory error
    while allocating the KV cache becomes an InvalidRequestError that says what to turn."""
    from asyncpaged.worker import instance as instance_module
    from asyncpaged.worker import runner as runner_module

    def no_room(**kwargs: object) -> object:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(instance_module, "PagedKVCache", no_room)
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization") as info:
        runner_module.ModelRunner(tiny_checkpoint("llama-gqa"), "float32", num_blocks=8)
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)


def test_a_cache_smaller_than_max_model_len_is_warned_at_start(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """vLLM refuses to start then; here the requests that would not fit are refused one by one
    (request_checks), and the start says so once, with what to set."""
    path = tiny_checkpoint("llama-gqa")
    hf_config = AutoConfig.from_pretrained(str(path))
    for blocks, warned in ((3, True), (16, False)):  # 48 and 256 tokens against 256
        with capture_logs() as logs:
            plan_model(EngineConfig(model=str(path), num_device_blocks=blocks, max_model_len=256),
                       hf_config)  # fmt: skip
        events = [e for e in logs if e["event"] == "kv_cache_below_max_model_len"]
        assert len(events) == warned
        if warned:
            assert events[0]["log_level"] == "warning"
            assert (events[0]["tokens"], events[0]["max_model_len"]) == (48, 256)
            assert "kv_cache_bytes" in events[0]["hint"]
