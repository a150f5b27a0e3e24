"""Every model family through the Triton backend (the interpreter on CPU, CUDA under
``scripts/gpu_check.sh``): greedy tokens equal to one-at-a-time transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncpaged.kernels.backend import TritonAttentionBackend
from asyncpaged.worker.runner import ModelRunner
from tests.model.conftest import hf_reference, tiny_checkpoint
from tests.model.driver import Driver, SimSequence
from tests.model.reference import HFReference

__all__ = ["hf_reference", "tiny_checkpoint"]  # the fixtures, for this folder

#: Softcapping (gemma2), q/k norms and head_dim != hidden/heads (qwen3, gemma3), MoE
#: (qwen3-moe, mixtral), sliding windows (mixtral, gemma2, gemma3, phi3-swa), partial rotary
#: and longrope (phi4-mini).
FAMILIES = ["qwen3", "qwen3-moe", "mixtral", "gemma2", "gemma3", "phi3-swa", "phi4-mini"]


def _sequences(chunked: bool) -> list[SimSequence]:
    """``chunked=False`` for longrope, which transformers switches per forward's length (as
    dynamic RoPE): a chunked prompt would legitimately differ from its one-shot prefill."""
    return [
        # 17 tokens: a page + 1; 17 + 3 stays under phi4-mini's longrope switch at 20 (the
        # runner alone does not restart a request that crosses it: the scheduler does)
        SimSequence(seq_id=0, prompt=tuple(range(5, 22)), max_new_tokens=3),
        SimSequence(seq_id=1, prompt=tuple(range(30, 45)), max_new_tokens=4, start_step=1),
        SimSequence(  # chunked prefill over a window's reach, while others decode
            seq_id=2,
            prompt=tuple(range(50, 83)),
            max_new_tokens=3,
            chunk_sizes=(16, 9, 8) if chunked else (),
        ),
    ]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_on_triton_matches_transformers(
    name: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    device: torch.device,
) -> None:
    runner = ModelRunner(tiny_checkpoint(name), "float32", num_blocks=32, device=device,
                         attn_backend=TritonAttentionBackend(),
                         kv_fill_value=float("nan"))  # fmt: skip
    seqs = _sequences(chunked=name != "phi4-mini")
    Driver(runner, seed=2).run(seqs)
    ref = hf_reference(name)
    for seq in seqs:
        assert seq.output == ref.generate(seq.prompt, seq.max_new_tokens)[0], seq.seq_id
