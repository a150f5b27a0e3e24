"""Tiny PEFT LoRA adapters for the tiny models (tests and examples; needs ``peft``).

:func:`build_tiny_lora` saves an adapter for a tiny checkpoint with random, non-zero A and B
(PEFT starts B at zero, which would leave the output unchanged); :func:`peft_greedy` is the
reference: transformers' greedy generation through PEFT with the adapter unmerged, float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_base(base_dir: str | Path) -> Any:
    """The base checkpoint as a float32 transformers model in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return model.eval()  # type: ignore[no-untyped-call]


def build_tiny_lora(
    base_dir: str | Path,
    directory: str | Path,
    *,
    seed: int = 1,
    r: int = 4,
    lora_alpha: int = 8,
    target_modules: Sequence[str] = LLAMA_TARGETS,
    use_rslora: bool = False,
    std: float = 0.2,
    **config: Any,
) -> Path:
    """Save a LoRA adapter for the checkpoint at ``base_dir`` into ``directory`` (PEFT's
    ``adapter_config.json`` and ``adapter_model.safetensors``); ``config``: more
    ``LoraConfig`` fields."""
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                             lora_dropout=0.0, use_rslora=use_rslora, **config)  # fmt: skip
    model = get_peft_model(load_base(base_dir), lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    path = Path(directory)
    model.save_pretrained(str(path))
    return path


def peft_greedy(
    base_dir: str | Path,
    adapter_dir: str | Path | None,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, through PEFT with the adapter unmerged
    (None: the base model alone)."""
    model = load_base(base_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # fmt: skip
            out.append(seq[0, len(prompt) :].tolist())
    return out
