"""The adapter a request runs with (vLLM's ``LoRARequest``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter for one request: a PEFT directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) at ``lora_path``.

    ``lora_name`` and ``lora_int_id`` name the adapter for the caller and the statistics; the
    engine keys its slots and its prefix cache on a digest of the directory's contents, so the
    same files under two names share cached blocks and changed files under one name never
    reuse the old ones."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}.")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}.")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
