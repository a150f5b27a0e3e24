"""transformers with K and V rounded exactly as a quantized paged KV cache stores them.

The exact reference of an int8 / fp8 KV cache (``EngineConfig.kv_cache_dtype``): inside
``rounded_kv(dtype)`` every transformers KV-cache update (``Cache.update``, which every model
calls with K after RoPE, as the paged cache stores it) replaces the new K and V rows by
``kv_quant.round_trip`` of them, so attention (this step's and every later one's) reads the
values the engine's cache gives back. Each row is rounded once, when it enters the cache, as in
the engine; rows already cached are never rounded again.

Used by the engine tests (token-identical to this reference) and by ``asyncpaged.tools.kv_accuracy``
(what the rounding costs against the unquantized cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncpaged.model.kv_quant import is_quantized, round_trip


@contextmanager
def rounded_kv(dtype: torch.dtype) -> Iterator[None]:
    """Within the block, transformers' KV caches round new K/V rows as a cache of ``dtype``
    (int8, float8_e4m3fn, float8_e5m2) does. Not thread-safe: it patches the class."""
    if not is_quantized(dtype):
        raise ValueError(f"rounded_kv takes a quantized KV dtype, got {dtype}.")
    from transformers.cache_utils import Cache

    original = Cache.update

    def update(
        self: Any,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [batch, kv_heads, T, head_dim]: one scale per (token, head), over head_dim
        key = round_trip(key_states, dtype).to(key_states.dtype)
        value = round_trip(value_states, dtype).to(value_states.dtype)
        result: tuple[torch.Tensor, torch.Tensor] = original(
            self, key, value, layer_idx, *args, **kwargs
        )
        return result

    Cache.update = update  # type: ignore[method-assign]
    try:
        yield
    finally:
        Cache.update = original  # type: ignore[method-assign]
