"""LoRA adapters through the engine: greedy tokens equal transformers with PEFT (unmerged,
float32), alone and mixed with the base model and other adapters under preemption; the
prefix cache keyed on the adapter's contents; more adapters than slots; bad adapters refused
before anything is queued."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import BeamSearchParams, InvalidRequestError, LoRARequest, SamplingParams
from asyncpaged.testing.tiny_lora import build_tiny_lora, load_base, peft_greedy
from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from tests.engine.conftest import running_engine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


MODEL = "llama-gqa"
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [11, 12, 13],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 7, 3, 30, 60, 90, 120]]  # fmt: skip
LORA = {"enable_lora": True, "executor_backend": "thread"}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The base checkpoint, three adapters (one rsLoRA, one of rank 8 on fewer modules) and
    each one's PEFT reference tokens for ``PROMPTS``."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_checkpoint(MODEL, root / "base")
    adapters = [
        build_tiny_lora(base, root / "a1", seed=1),
        build_tiny_lora(base, root / "a2", seed=2, use_rslora=True),
        build_tiny_lora(base, root / "a3", seed=3, r=8, lora_alpha=4,
                        target_modules=("q_proj", "v_proj", "down_proj")),
    ]  # fmt: skip
    want = {None: peft_greedy(base, None, PROMPTS, MAX_TOKENS)}
    for a in adapters:
        want[a] = peft_greedy(base, a, PROMPTS, MAX_TOKENS)
    assert all(want[a] != want[None] for a in adapters)  # every adapter changes the output
    return {"root": root, "base": base, "adapters": adapters, "want": want}


def _request(path: Path | None, i: int) -> LoRARequest | None:
    return None if path is None else LoRARequest(f"adapter-{i}", i, str(path))


async def _run_all(engine: Any, jobs: Sequence[tuple[list[int], LoRARequest | None]]) -> list[Any]:
    outs: list[Any] = [None] * len(jobs)

    async def one(i: int) -> None:
        prompt, lora = jobs[i]
        outs[i] = await engine.generate(prompt, GREEDY, lora_request=lora)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(len(jobs)):
                tg.start_soon(one, i)
    return outs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
async def test_mixed_batch_matches_peft_under_preemption(
    mode: str, lora_setup: dict[str, Any]
) -> None:
    """The base model and three adapters in the same steps, on a cache small enough that
    requests are preempted (swapped or recomputed): every request's tokens are PEFT's, and the
    base model's are transformers' alone. (Recompute runs with async scheduling: steps planned
    ahead carry their slots too.)"""
    base, want = lora_setup["base"], lora_setup["want"]
    paths: list[Path | None] = [None, *lora_setup["adapters"]]
    jobs = [(p, _request(a, i)) for i, a in enumerate(paths) for p in PROMPTS]
    async with running_engine(base, num_device_blocks=12, block_size=4, max_loras=4,
                              preemption_mode=mode, async_scheduling=mode == "recompute",
                              **LORA) as engine:  # fmt: skip
        outs = await _run_all(engine, jobs)
        stats = engine.statistics()
    for (prompt, lora), out in zip(jobs, outs, strict=True):
        path = None if lora is None else Path(lora.lora_path)
        assert out.outputs[0].token_ids == want[path][PROMPTS.index(prompt)], (lora, prompt)
    assert stats.num_preemptions > 0
    assert (stats.num_swap_outs if mode == "swap" else stats.num_recomputes) > 0
    assert stats.num_lora_loads == 3
    assert (stats.num_steps_planned_ahead > 0) == (mode == "recompute")


FAMILIES = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),  # fused q/k/v, Conv1D weights
    "phi3-swa": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # fused projections
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_families_match_peft(family: str, tmp_path: Path) -> None:
    base = build_tiny_checkpoint(family, tmp_path / "base")
    adapter = build_tiny_lora(base, tmp_path / "a", seed=4, target_modules=FAMILIES[family],
                              fan_in_fan_out=family == "gpt2")  # fmt: skip
    prompts = PROMPTS[:2]
    want = peft_greedy(base, adapter, prompts, MAX_TOKENS)
    assert want != peft_greedy(base, None, prompts, MAX_TOKENS)
    async with running_engine(base, num_device_blocks=64, **LORA) as engine:
        outs = await _run_all(engine, [(p, _request(adapter, 1)) for p in prompts])
    assert [o.outputs[0].token_ids for o in outs] == want


async def test_reloaded_weights_under_the_same_name_never_hit_old_blocks(
    lora_setup: dict[str, Any], tmp_path: Path
) -> None:
    """An adapter directory rewritten with other weights, requested under the same name and
    id: the prompt's blocks cached with the old weights are not reused (the prefix key holds
    the adapter's digest), and the tokens are the new weights' PEFT tokens. The same adapter
    under another name shares the cached blocks."""
    base = lora_setup["base"]
    adapter = tmp_path / "live"
    shutil.copytree(lora_setup["adapters"][0], adapter)
    prompt = PROMPTS[0]  # 17 tokens: four full blocks of 4
    lora = LoRARequest("live", 1, str(adapter))
    async with running_engine(base, num_device_blocks=64, block_size=4, **LORA) as engine:
        first = await engine.generate(prompt, GREEDY, lora_request=lora)
        assert first.outputs[0].token_ids == lora_setup["want"][lora_setup["adapters"][0]][0]
        alias = await engine.generate(
            prompt, GREEDY, lora_request=LoRARequest("alias", 2, str(adapter))
        )
        assert alias.num_cached_tokens == 16  # same contents, other name: shared blocks
        build_tiny_lora(base, tmp_path / "new", seed=9)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(tmp_path / "new" / name, adapter / name)
        again = await engine.generate(prompt, GREEDY, lora_request=lora)
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == peft_greedy(base, adapter, [prompt], MAX_TOKENS)[0]


async def test_more_adapters_than_slots(lora_setup: dict[str, Any]) -> None:
    """Requests for 8 adapters with 2 slots: they wait for a slot, never refused, and all
    finish with PEFT's tokens; every slot load is counted."""
    base, root = lora_setup["base"], lora_setup["root"]
    adapters = [build_tiny_lora(base, root / f"many{i}", seed=20 + i, r=2) for i in range(8)]
    prompt = PROMPTS[1]
    want = {a: peft_greedy(base, a, [prompt], MAX_TOKENS)[0] for a in adapters}
    jobs = [(prompt, _request(a, i + 1)) for i, a in enumerate(adapters)]
    async with running_engine(base, max_loras=2, max_cpu_loras=3, **LORA) as engine:
        outs = await _run_all(engine, jobs + jobs[:2])
        stats = engine.statistics()
    for (_, lora), out in zip(jobs + jobs[:2], outs, strict=True):
        assert lora is not None
        assert out.outputs[0].token_ids == want[Path(lora.lora_path)]
    assert stats.num_lora_loads >= 8


async def test_parallel_sampling_and_beam_search_carry_the_adapter(
    lora_setup: dict[str, Any],
) -> None:
    from peft import PeftModel

    base, adapter = lora_setup["base"], lora_setup["adapters"][1]
    lora = _request(adapter, 1)
    prompt = PROMPTS[2]
    beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    async with running_engine(base, num_device_blocks=64, **LORA) as engine:
        two = await engine.generate(prompt, SamplingParams(n=2, temperature=0.0,
                                    max_tokens=MAX_TOKENS, ignore_eos=True),
                                    lora_request=lora)  # fmt: skip
        beams = await engine.beam_search(prompt, beam, lora_request=lora)
    want = lora_setup["want"][adapter][2]
    assert [c.token_ids for c in two.outputs] == [want, want]
    model = PeftModel.from_pretrained(load_base(base), str(adapter)).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             num_beams=3, num_return_sequences=3, max_new_tokens=6,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert [c.token_ids for c in beams.outputs] == out[:, len(prompt) :].tolist()


def _edit(src: Path, dst: Path, *, config: dict[str, Any] | None = None,
          tensors: Any = None) -> Path:  # fmt: skip
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        weights = tensors(load_file(str(dst / "adapter_model.safetensors")))
        save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


def _renamed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("q_proj", "r_proj"): v for k, v in weights.items()}


def _widened(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([v, v]) if "q_proj.lora_B" in k else v for k, v in weights.items()}


def _with_bias(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    key = next(k for k in weights if k.endswith("q_proj.lora_B.weight"))
    return {**weights, key.replace(".weight", ".bias"): torch.zeros(weights[key].shape[0])}


async def test_bad_adapters_fail_alone_before_queueing(
    lora_setup: dict[str, Any], tmp_path: Path
) -> None:
    base, good = lora_setup["base"], lora_setup["adapters"][0]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"")
    bad = {
        "is not a directory": tmp_path / "missing",
        "is not JSON": tmp_path / "broken",
        "above max_lora_rank": lora_setup["adapters"][2],  # rank 8 > 4
        "which the model lacks": _edit(good, tmp_path / "renamed", tensors=_renamed),
        "another base model": _edit(good, tmp_path / "wide", tensors=_widened),
        "bias='all' is not supported": _edit(good, tmp_path / "bias", config={"bias": "all"}),
        "not supported (only lora_A": _edit(good, tmp_path / "tensor", tensors=_with_bias),
    }
    async with running_engine(base, max_lora_rank=4, **LORA) as engine:
        for i, (message, path) in enumerate(bad.items()):
            with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(")):
                engine.generate(
                    PROMPTS[1], GREEDY, lora_request=LoRARequest("bad", i + 1, str(path))
                )
        out = await engine.generate(PROMPTS[1], GREEDY, lora_request=_request(good, 9))
        assert engine.statistics().num_lora_loads == 1
    assert out.outputs[0].token_ids == lora_setup["want"][good][1]


async def test_speculation_verifies_with_the_adapter(lora_setup: dict[str, Any]) -> None:
    """Prompt-lookup proposals are verified by the target with the request's adapter: the
    tokens stay PEFT's."""
    from asyncpaged import SpeculativeConfig

    base, adapter = lora_setup["base"], lora_setup["adapters"][0]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2,
                             prompt_lookup_min=1)  # fmt: skip
    async with running_engine(base, speculative_config=spec, **LORA) as engine:
        outs = await _run_all(engine, [(p, _request(adapter, 1)) for p in PROMPTS])
        assert engine.statistics().num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == lora_setup["want"][adapter]


async def test_lora_request_needs_enable_lora(lora_setup: dict[str, Any]) -> None:
    async with running_engine(lora_setup["base"], executor_backend="thread") as engine:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            engine.generate(PROMPTS[1], GREEDY,
                            lora_request=_request(lora_setup["adapters"][0], 1))  # fmt: skip


def test_lora_settings_are_checked_at_config() -> None:
    from asyncpaged import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(model="m", enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/nowhere")
