"""Beam search in the engine equals transformers' ``generate(num_beams=...)``."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncpaged import BeamSearchParams
from tests.engine.conftest import running_engine
from tests.engine.test_engine import make_prompts

pytestmark = pytest.mark.anyio
EOS = 2  # the tiny tokenizer's </s>


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def eos_prone_llama(tiny_checkpoint: Callable[[str], Path], tmp_path_factory: Any) -> Path:
    """The tiny Llama with EOS's output row made a near copy of a common token's, so that beams
    actually end at EOS."""
    src = tiny_checkpoint("llama-gqa")
    dst = tmp_path_factory.mktemp("llama-eos")
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    weights = load_file(str(src / "model.safetensors"))
    head = weights["lm_head.weight"]
    # The token greedy decoding picks most often on the test prompts: EOS becomes its twin.
    from collections import Counter

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    counts: Counter[int] = Counter()
    for prompt in make_prompts(4, seed=21, max_len=30):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=10, eos_token_id=None, pad_token_id=0)  # fmt: skip
        counts.update(out[0, len(prompt) :].tolist())
    common = counts.most_common(1)[0][0]
    generator = torch.Generator().manual_seed(0)
    head[EOS] = head[common] + 0.05 * torch.randn(head.shape[1], generator=generator)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def hf_beam_search(
    path: Path, prompt: tuple[int, ...], params: BeamSearchParams
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=None if params.ignore_eos else EOS,
            pad_token_id=0,
        )
    beams = []
    for row in out[:, len(prompt) :].tolist():
        end = row.index(EOS) + 1 if EOS in row and not params.ignore_eos else len(row)
        beams.append(row[:end])
    return beams


CASES = [
    ("llama-eos", BeamSearchParams(beam_width=4, max_tokens=8)),
    ("llama-eos", BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.6)),
    ("llama-eos", BeamSearchParams(beam_width=3, max_tokens=10, early_stopping=True)),
    (
        "llama-eos",
        BeamSearchParams(beam_width=2, max_tokens=8, early_stopping="never", length_penalty=0.0),
    ),
    ("gpt2", BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)),
    ("opt", BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=2.0)),
]


@pytest.mark.parametrize(("model", "params"), CASES)
async def test_beam_search_matches_transformers(
    model: str,
    params: BeamSearchParams,
    tiny_checkpoint: Callable[[str], Path],
    eos_prone_llama: Path,
) -> None:
    path = eos_prone_llama if model == "llama-eos" else tiny_checkpoint(model)
    prompts = make_prompts(4, seed=21, max_len=30)[1:]  # 16, 17 and a random length
    async with running_engine(path, num_device_blocks=96) as engine:
        outs = [await engine.beam_search(list(p), params) for p in prompts]
        stats = engine.statistics()
    ended_at_eos = False
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_beam_search(path, prompt, params)
        assert [c.token_ids for c in out.outputs] == want, prompt
        ended_at_eos |= any(c.finish_reason == "stop" for c in out.outputs)
        scores = [c.cumulative_logprob for c in out.outputs]
        assert all(s is not None for s in scores)
    assert stats.num_cow_copies > 0  # beams forked off shared partial blocks
    if model == "llama-eos":
        assert ended_at_eos


async def test_beam_search_survives_preemption(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama-gqa")
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    prompts = make_prompts(6, seed=22, max_len=30)
    async with running_engine(path, num_device_blocks=96) as engine:
        alone = [await engine.beam_search(list(p), params) for p in prompts]
    for mode in ("recompute", "swap"):
        async with running_engine(path, num_device_blocks=12, preemption_mode=mode) as engine:
            import anyio

            crowded: dict[int, Any] = {}

            async def one(i: int, engine: Any = engine, crowded: dict[int, Any] = crowded) -> None:
                crowded[i] = await engine.beam_search(list(prompts[i]), params)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            assert engine.statistics().num_preemptions > 0
        for i, out in enumerate(alone):
            assert [c.token_ids for c in crowded[i].outputs] == [c.token_ids for c in out.outputs]
