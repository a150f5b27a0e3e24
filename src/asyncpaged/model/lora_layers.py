"""LoRA adapters in device slots, added to the model's linears per group of rows.

```text
 per target linear (LoRALinear, attached to the nn.Linear as ``lora``):
   a [max_loras, max_lora_rank, in]    zero-padded ranks: loading a slot is a copy
   b [max_loras, out, max_lora_rank]
 per step (LoRAStep): the groups (slot, token rows), one per adapter in the step
 linear(x) = base(x);  out[rows] += scaling[slot] * (x[rows] @ a[slot, :r].T) @ b[slot, :, :r].T
```

One pair of small GEMMs (shrink, expand) per adapter of the step over its rows: no Python loop
per row, and nothing at all for a step without adapter rows (``LoRAStep.groups`` is empty) or a
model without LoRA (no ``lora`` attribute on its linears). The order of operations is PEFT's
for an unmerged adapter, so float32 outputs match it.

:class:`LoRAWeights` owns the slots and a host LRU of adapters read from disk
(``max_cpu_loras``); the scheduler decides which adapter sits in which slot
(``sched/lora_slots.py``) and the runner loads them before the step's forward.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncpaged._log import get_logger
from asyncpaged.model.lora_adapter import AdapterWeights, read_adapter

_log = get_logger(__name__)

LORA_ATTR = "lora"


class LoRAStep:
    """The row groups of the step running now: (slot, token rows [n] int64), sorted by slot."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []

    def begin(self, token_slots: np.ndarray, device: torch.device) -> None:
        """Group the step's tokens by slot (``token_slots`` [T], -1: the base model): one
        stable argsort, split where the slot changes."""
        if token_slots.size == 0 or int(token_slots.max()) < 0:
            self.groups = []
            return
        order = np.argsort(token_slots, kind="stable")
        bounds = np.flatnonzero(np.diff(token_slots[order])) + 1
        groups = []
        for seg in np.split(order, bounds):  # one segment per distinct slot
            slot = int(token_slots[seg[0]])
            if slot >= 0:
                groups.append((slot, torch.from_numpy(np.ascontiguousarray(seg)).to(device)))
        self.groups = groups

    def end(self) -> None:
        self.groups = []


class LoRALinear:
    """One linear layer's adapters, stacked over the slots."""

    def __init__(self, layer: nn.Linear, max_loras: int, max_rank: int, step: LoRAStep) -> None:
        weight = layer.__dict__.get("packed_weight")
        ref = weight if weight is not None else layer.weight
        device, dtype = ref.device, ref.dtype
        self.a = torch.zeros(max_loras, max_rank, layer.in_features, device=device, dtype=dtype)
        self.b = torch.zeros(max_loras, layer.out_features, max_rank, device=device, dtype=dtype)
        self.ranks = [0] * max_loras  # 0: the slot's adapter leaves this layer alone
        self.scaling = [0.0] * max_loras
        self.step = step

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Copy an adapter's A [r, in] and B [out, r] into ``slot``."""
        r = a.shape[0]
        assert a.shape[1] == self.a.shape[2], f"LoRA A {tuple(a.shape)} != {tuple(self.a.shape)}"
        assert b.shape[0] == self.b.shape[1], f"LoRA B {tuple(b.shape)} != {tuple(self.b.shape)}"
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :r].copy_(a)
        self.b[slot, :, :r].copy_(b)
        self.ranks[slot], self.scaling[slot] = r, scaling

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` [T, out] plus each group's LoRA product of ``x`` [T, in] (in place)."""
        for slot, rows in self.step.groups:
            r = self.ranks[slot]
            if r == 0:
                continue
            xs = x.index_select(0, rows)  # [n, in]
            delta = F.linear(F.linear(xs, self.a[slot, :r]), self.b[slot, :, :r])  # [n, out]
            out.index_add_(0, rows, delta * self.scaling[slot])
        return out


def lora_of(layer: nn.Linear) -> LoRALinear | None:
    """The adapters attached to ``layer`` (None: none)."""
    lora = layer.__dict__.get(LORA_ATTR)
    return lora if isinstance(lora, LoRALinear) else None


class LoRATarget(Protocol):
    """What :class:`LoRAWeights` needs of a model (a ``CausalLM``)."""

    def parameter_name(self, checkpoint_name: str) -> str: ...

    def get_submodule(self, target: str) -> nn.Module: ...


class LoRAWeights:
    """The adapter slots of one model and the host LRU behind them.

    Invariants: ``slots[i]`` is the digest of the adapter whose weights every attached
    :class:`LoRALinear` holds in slot ``i`` (None: empty); the host LRU holds at most
    ``max_cpu_loras`` adapters; the step's groups are set only during a forward."""

    def __init__(
        self, model: LoRATarget, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int
    ) -> None:
        self._model = model
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, 1)
        self.step = LoRAStep()
        self._layers: dict[str, LoRALinear] = {}
        self._host: OrderedDict[str, AdapterWeights] = OrderedDict()
        self.slots: list[str | None] = [None] * max_loras
        self.num_disk_reads = 0

    def _layer(self, module: str) -> LoRALinear:
        layer = self._layers.get(module)
        if layer is not None:
            return layer
        name = self._model.parameter_name(module + ".weight").removesuffix(".weight")
        target = self._model.get_submodule(name)
        assert isinstance(target, nn.Linear), f"LoRA target {name!r} is not a linear layer"
        layer = LoRALinear(target, self.max_loras, self.max_lora_rank, self.step)
        target.__dict__[LORA_ATTR] = layer
        self._layers[module] = layer
        return layer

    def _adapter(self, path: str, digest: str) -> AdapterWeights:
        adapter = self._host.get(digest)
        if adapter is not None:
            self._host.move_to_end(digest)
            return adapter
        adapter = read_adapter(path)
        assert adapter.digest == digest, f"LoRA adapter {path!r} changed after it was checked"
        self.num_disk_reads += 1
        self._host[digest] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def load(self, slot: int, path: str, digest: str) -> None:
        """Put the adapter ``digest`` (read from ``path`` unless the host LRU has it) in
        ``slot``; nothing to do when it is there already."""
        if self.slots[slot] == digest:
            return
        adapter = self._adapter(path, digest)
        for layer in self._layers.values():
            layer.clear(slot)
        for module, (a, b) in adapter.weights.items():
            self._layer(module).set(slot, a, b, adapter.scaling)
        self.slots[slot] = digest
        _log.debug("lora_slot_loaded", slot=slot, digest=digest[:12])

    def begin_step(self, token_slots: np.ndarray, device: torch.device) -> None:
        """The step's groups from each token's slot (-1: the base model)."""
        self.step.begin(token_slots, device)

    def end_step(self) -> None:
        self.step.end()
