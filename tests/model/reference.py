"""The correctness oracle: transformers' own ``generate`` (greedy) and forward on a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class HFReference:
    """Greedy continuations and their log-softmax values, one prompt at a time (no padding)."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        self.path = path
        self.dtype = dtype
        self._cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}
        self._model: Any = None

    def _load(self) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        # Attention softcapping (Gemma 2) is eager attention's alone: transformers 5.17 still ran
        # Gemma 2 through SDPA by default, which drops the cap (an H100 run's reference diverged);
        # 5.25 refuses SDPA for it. Ask for eager so every version computes the model's definition.
        config = AutoConfig.from_pretrained(str(self.path))
        softcapped = getattr(config, "attn_logit_softcapping", None) is not None
        model = AutoModelForCausalLM.from_pretrained(
            str(self.path),
            dtype=self.dtype,
            **({"attn_implementation": "eager"} if softcapped else {}),
        )
        return model.eval()

    def generate(
        self, prompt: tuple[int, ...], max_new_tokens: int
    ) -> tuple[list[int], list[float]]:
        """(greedy tokens, log-softmax of each chosen token) for ``prompt``; EOS does not stop."""
        key = (prompt, max_new_tokens)
        if key not in self._cache:
            model = self._model
            # transformers' dynamic RoPE keeps state across calls: use a fresh model for it.
            rope = getattr(model.config, "rope_parameters", None) if model is not None else None
            if model is None or (rope or {}).get("rope_type") == "dynamic":
                model = self._model = self._load()
            ids = torch.tensor([prompt], dtype=torch.int64)
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=0,
                    eos_token_id=None,
                    pad_token_id=0,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                float(torch.log_softmax(step_logits[0].float(), dim=-1)[tok])
                for step_logits, tok in zip(out.logits, tokens, strict=True)
            ]
            self._cache[key] = (tokens, logprobs)
        return self._cache[key]

    def score(self, prompt: tuple[int, ...], continuation: tuple[int, ...]) -> torch.Tensor:
        """Teacher-forced log-softmax [len(continuation), V] (float32) of transformers' logits
        for each continuation token, from one forward over prompt + continuation."""
        if self._model is None:
            self._model = self._load()
        ids = torch.tensor([prompt + continuation], dtype=torch.int64)
        with torch.no_grad():
            logits = self._model(ids, attention_mask=torch.ones_like(ids)).logits[0]
        steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)].float()
        return torch.log_softmax(steps, dim=-1)


class RoundedKVReference(HFReference):
    """``HFReference`` whose attention sees K and V rounded as a quantized paged cache of
    ``kv_dtype`` stores them (``asyncpaged.testing.kv_rounding``): the exact reference of an
    int8 / fp8 KV cache."""

    def __init__(
        self, path: Path, kv_dtype: torch.dtype, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(path, dtype)
        self.kv_dtype = kv_dtype

    def generate(
        self, prompt: tuple[int, ...], max_new_tokens: int
    ) -> tuple[list[int], list[float]]:
        from asyncpaged.testing.kv_rounding import rounded_kv

        with rounded_kv(self.kv_dtype):
            return super().generate(prompt, max_new_tokens)

    def score(self, prompt: tuple[int, ...], continuation: tuple[int, ...]) -> torch.Tensor:
        from asyncpaged.testing.kv_rounding import rounded_kv

        with rounded_kv(self.kv_dtype):
            return super().score(prompt, continuation)
