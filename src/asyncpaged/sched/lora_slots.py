"""Which LoRA adapter sits in which device slot (pure Python).

The scheduler admits a request with an adapter only while the requests holding blocks use at
most ``max_loras`` distinct adapters (``Scheduler``), so every step's adapters fit the slots;
:class:`LoRASlots` maps each step's adapters to slots, keeping one already loaded where it is
and otherwise taking a free slot or the least recently used one that the step does not need.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LoRASlots:
    """Adapter digest -> slot, least recently used first.

    Invariants: at most ``max_loras`` adapters hold slots, each its own; ``num_loads`` counts
    every adapter put into a slot (a load the runner performs)."""

    def __init__(self, max_loras: int) -> None:
        assert max_loras >= 1, f"max_loras must be at least 1, got {max_loras}"
        self.max_loras = max_loras
        self._slot_of: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0

    def assign(self, digests: Iterable[str]) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """The slot of each adapter a step uses, and the (slot, digest) loads that puts them
        there first."""
        wanted = list(dict.fromkeys(digests))
        assert len(wanted) <= self.max_loras, (
            f"a step uses {len(wanted)} adapters, above max_loras={self.max_loras}"
        )
        loads: list[tuple[int, str]] = []
        for digest in wanted:
            if digest in self._slot_of:
                self._slot_of.move_to_end(digest)
        for digest in wanted:
            if digest in self._slot_of:
                continue
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(d for d in self._slot_of if d not in wanted)
                slot = self._slot_of.pop(victim)
            self._slot_of[digest] = slot
            loads.append((slot, digest))
            self.num_loads += 1
        return {d: self._slot_of[d] for d in wanted}, loads

    def slot_of(self, digest: str) -> int | None:
        return self._slot_of.get(digest)
