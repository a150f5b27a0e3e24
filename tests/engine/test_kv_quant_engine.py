"""Quantized KV caches (int8, fp8) through the whole engine: token-identical to transformers whose
attention sees K and V rounded exactly as the cache rounds them (``RoundedKVReference``), under
swap and recompute preemption, prefix hits, n > 1 and beams; blocks sized in bytes; bad settings
refused at start. The engines run the default backend, the native CPU kernels (where g++ builds
them; the torch path otherwise), whose float32 sums run in another order than transformers':
the tokens are the real check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoConfig

from asyncpaged import (
    BeamSearchParams,
    EngineConfig,
    InvalidRequestError,
    SamplingParams,
    SpeculativeConfig,
)
from asyncpaged.config import KVShape
from asyncpaged.engine.build import attention_backend_for, plan_model
from asyncpaged.kernels import cpu_attention
from asyncpaged.model.kv_quant import KV_QUANT_DTYPES
from asyncpaged.testing.kv_rounding import rounded_kv
from tests.engine.conftest import running_engine
from tests.engine.test_beam_search import hf_beam_search
from tests.engine.test_engine import generate_all, make_prompts
from tests.model.reference import RoundedKVReference

pytestmark = pytest.mark.anyio
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# (family, kv dtype, preemption): every dtype, both preemptions, families with GQA, a sliding
# window and softcapping (gemma2), learned positions (opt)
CASES = [
    ("llama-gqa", "int8", "swap"),
    ("llama-gqa", "fp8", "recompute"),
    ("gemma2", "fp8_e5m2", "swap"),
    ("opt", "int8", "recompute"),
    ("qwen3", "fp8_e4m3", "swap"),
]


@pytest.mark.parametrize(("name", "kv_dtype", "mode"), CASES)
async def test_quantized_cache_matches_the_rounding_reference_under_preemption(
    name: str, kv_dtype: str, mode: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(name)
    ref = RoundedKVReference(path, KV_QUANT_DTYPES[kv_dtype])
    prompts = make_prompts(10, seed=4)  # 15, 16, 17, 1, 32, 33 tokens and 4 more up to 40
    with anyio.fail_after(120):
        async with running_engine(path, num_device_blocks=7, preemption_mode=mode,
                                  kv_cache_dtype=kv_dtype) as engine:  # fmt: skip
            cache = engine.runner.kv_cache
            assert cache.dtype == KV_QUANT_DTYPES[kv_dtype] and cache.is_quantized
            backend = engine.runner.model.attn_backend
            want_native = cpu_attention.is_available()
            assert isinstance(backend, cpu_attention.CpuAttentionBackend) == want_native
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], (name, len(prompt))
    assert stats.num_preemptions > 0
    assert (stats.num_swap_outs > 0) == (mode == "swap")


async def test_prefix_hits_n_and_beams_match_the_rounding_reference(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """int8 on a byte budget: the cache's bytes (codes and scales) fill it; a prompt that hits
    the prefix cache, n = 3 greedy completions on forked blocks and a beam search (copy-on-write
    of partial blocks) give the rounding reference's tokens."""
    path = tiny_checkpoint("llama-gqa")
    kv_dtype = KV_QUANT_DTYPES["int8"]
    ref = RoundedKVReference(path, kv_dtype)
    prefix = (*make_prompts(1, seed=9, max_len=60)[0], *range(100, 140))  # 55 tokens
    prompts = [(*prefix, 7, 8), (*prefix, 9), prefix[:40]]
    budget = 300_000
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    with anyio.fail_after(120):
        async with running_engine(path, kv_cache_bytes=budget, kv_cache_dtype="int8") as engine:
            cache = engine.runner.kv_cache
            # blocks of 16 tokens: 2 layers x 2 KV heads x (16 codes + a 2-byte scale) x K, V
            block_bytes = 2 * 2 * 2 * 16 * (16 + 2)
            assert cache.num_bytes == engine.num_device_blocks * block_bytes
            assert budget - block_bytes < cache.num_bytes <= budget
            first = await engine.generate(list(prompts[0]), GREEDY)
            hits = await generate_all(engine, prompts[1:], GREEDY)
            stats = engine.statistics()
            n3_params = SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True)
            n3 = await engine.generate(list(prompts[1]), n3_params)
            beams = await engine.beam_search(list(prompts[2]), params)
            cow = engine.statistics().num_cow_copies
    assert stats.prefix_cache_hit_tokens >= 2 * 32
    for prompt, out in zip(prompts, [first, *hits], strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], len(prompt)
    want = ref.generate(prompts[1], 10)[0]
    assert [c.token_ids for c in n3.outputs] == [want] * 3
    with rounded_kv(kv_dtype):
        want_beams = hf_beam_search(path, prompts[2], params)
    assert [c.token_ids for c in beams.outputs] == want_beams
    assert cow > 0


def test_blocks_are_sized_in_bytes_scales_included(tiny_checkpoint: Callable[[str], Path]) -> None:
    """The same kv_cache_bytes: int8 and fp8 hold 1.94x bfloat16's blocks and 3.88x float32's
    at head_dim 64 (66 bytes per token and head against 128 and 256)."""
    hf_config = AutoConfig.for_model(
        "llama", hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
        num_hidden_layers=6, intermediate_size=1376, vocab_size=1000,
    )  # fmt: skip
    path = str(tiny_checkpoint("llama-gqa"))
    budget = 64 * 2**20
    blocks = {}
    for name in ("float32", "bfloat16", "int8", "fp8", "fp8_e5m2"):
        cfg = EngineConfig(model=path, dtype="float32", kv_cache_bytes=budget, kv_cache_dtype=name)
        plan = plan_model(cfg, hf_config)
        blocks[name] = plan.num_device_blocks
        shape = KVShape.from_hf_config(hf_config, plan.kv_dtype.itemsize,
                                       scale_bytes=2 if name in KV_QUANT_DTYPES else 0)  # fmt: skip
        assert blocks[name] == budget // shape.block_bytes(16)
    assert blocks["int8"] == blocks["fp8"] == blocks["fp8_e5m2"]
    assert blocks["int8"] >= 1.9 * blocks["bfloat16"]
    assert blocks["int8"] >= 3.8 * blocks["float32"]


async def test_bad_kv_settings_are_refused_at_start(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    path = tiny_checkpoint("llama-gqa")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        EngineConfig(model=str(path), kv_cache_dtype="int4")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="cannot read a quantized cache"):
        async with running_engine(path, kv_cache_dtype="fp8", attention_backend="triton",
                                  num_device_blocks=16):  # fmt: skip
            pass
    # On the CPU "auto" and "cpu" take the native kernels, as for any cache
    with capture_logs() as logs:
        for choice in ("auto", "cpu", "torch"):
            cfg = EngineConfig(model=str(path), kv_cache_dtype="int8", attention_backend=choice)
            assert attention_backend_for(cfg, torch.int8) == choice
    assert logs == []
    # On CUDA "auto" takes the torch path (Triton does not read it yet), and says why
    cfg = EngineConfig(model=str(path), kv_cache_dtype="int8", device="cuda")
    with capture_logs() as logs:
        assert attention_backend_for(cfg, torch.int8) == "torch"
    assert [e["event"] for e in logs] == ["kv_cache_quantized_attention"]
    assert attention_backend_for(cfg, torch.bfloat16) == "auto"


async def test_host_and_disk_tiers_carry_the_scales_and_name_the_kv_dtype(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """int8 blocks evicted to the host tier come back as they were; on disk (written at close)
    a restart in int8 hits them, one in fp8 never reads them (another identity): every time
    the rounding reference's tokens."""
    path = tiny_checkpoint("llama-gqa")
    rng = torch.Generator().manual_seed(3)
    prefix = torch.randint(4, 300, (96,), generator=rng).tolist()  # 6 full blocks
    flush = [torch.randint(4, 300, (100,), generator=rng).tolist() for _ in range(2)]
    second = [*prefix, 7, 8, 9]
    refs = {name: RoundedKVReference(path, KV_QUANT_DTYPES[name]) for name in ("int8", "fp8")}
    tiers = {"kv_offload_host_bytes": 1 << 20, "kv_offload_dir": str(tmp_path),
             "kv_offload_disk_bytes": 1 << 22}  # fmt: skip

    async def turns(kv_dtype: str, prompts: list[list[int]]) -> tuple[list[list[int]], Any]:
        with anyio.fail_after(120):
            async with running_engine(path, num_device_blocks=12, kv_cache_dtype=kv_dtype,
                                      **tiers) as engine:  # fmt: skip
                outs = [(await engine.generate(p, GREEDY)).outputs[0].token_ids for p in prompts]
                return outs, engine.statistics()

    outs, stats = await turns("int8", [[*prefix, 5], *flush, second])
    assert stats.prefix_cache_host_hit_tokens > 0
    assert outs[3] == refs["int8"].generate(tuple(second), 10)[0]
    outs, stats = await turns("int8", [second])
    assert stats.prefix_cache_disk_hit_tokens > 0
    assert outs[0] == refs["int8"].generate(tuple(second), 10)[0]
    outs, stats = await turns("fp8", [second])
    assert stats.prefix_cache_disk_hit_tokens == 0
    assert outs[0] == refs["fp8"].generate(tuple(second), 10)[0]
    assert len(list(tmp_path.iterdir())) == 2  # one folder per KV dtype


async def test_a_draft_model_keeps_its_own_quantized_cache(
    tiny_checkpoint: Callable[[str], Path], perturbed_draft: Callable[[str], Path]
) -> None:
    """Speculative decoding with a draft model: both caches in fp8 (the draft's swapped with the
    target's blocks), the target's tokens are the rounding reference's."""
    path = tiny_checkpoint("llama-gqa")
    ref = RoundedKVReference(path, KV_QUANT_DTYPES["fp8"])
    prompts = make_prompts(8, seed=8)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=4,
                             model=str(perturbed_draft("llama-gqa")))  # fmt: skip
    with anyio.fail_after(120):
        async with running_engine(
            path, num_device_blocks=6, preemption_mode="swap", kv_cache_dtype="fp8",
            speculative_config=spec,
        ) as engine:  # fmt: skip
            assert engine.runner.draft is not None
            assert engine.runner.draft.kv_cache.dtype == torch.float8_e4m3fn
            outs = await generate_all(engine, prompts, GREEDY)
            stats = engine.statistics()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == ref.generate(prompt, 10)[0], prompt
    assert stats.num_swap_outs > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
