"""The grouped LoRA product against a float64 per-row reference, and the slot LRU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from asyncpaged.model.lora_layers import LoRALinear, LoRAStep
from asyncpaged.model.packed_linear import linear
from asyncpaged.sched.lora_slots import LoRASlots


def test_grouped_product_matches_float64_per_row() -> None:
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(24, 40, bias=False)
    step = LoRAStep()
    lora = LoRALinear(layer, max_loras=3, max_rank=8, step=step)
    ranks, scalings = [8, 2, 5], [0.5, 3.0, 1.25]
    pairs = []
    for slot, (r, s) in enumerate(zip(ranks, scalings, strict=True)):
        a, b = torch.randn(r, 24, generator=g), torch.randn(40, r, generator=g)
        lora.set(slot, a, b, s)
        pairs.append((a.double(), b.double(), s))
    layer.__dict__["lora"] = lora
    token_slots = np.array([2, -1, 0, 2, 1, 1, -1, 0, 2], dtype=np.int64)  # -1: the base model
    step.begin(token_slots, torch.device("cpu"))
    x = torch.randn(len(token_slots), 24, generator=g)
    got = linear(layer, x).double()
    want = x.double() @ layer.weight.double().T
    for i, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            a, b, s = pairs[slot]
            want[i] += s * (x[i].double() @ a.T) @ b.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    step.end()  # no groups: the base linear alone, untouched
    torch.testing.assert_close(linear(layer, x), x @ layer.weight.T)


def test_slots_keep_loaded_adapters_and_evict_the_least_recently_used() -> None:
    slots = LoRASlots(2)
    assert slots.assign(["a", "b"]) == ({"a": 0, "b": 1}, [(0, "a"), (1, "b")])
    assert slots.assign(["b"]) == ({"b": 1}, [])
    assert slots.assign(["c", "b"]) == ({"c": 0, "b": 1}, [(0, "c")])  # "a" was the LRU
    assert slots.num_loads == 3
    with pytest.raises(AssertionError, match="above max_loras"):
        slots.assign(["x", "y", "z"])
