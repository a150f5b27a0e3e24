"""Keeping Python's cyclic GC off the host loop's tail latency (``EngineConfig.gc_freeze``)
and off its steps (``EngineConfig.gc_threshold``).

A generation-2 collection walks every tracked object; after a model, a tokenizer and
transformers are loaded that is hundreds of thousands of them, and each walk stalls the event
loop for 100+ ms although almost none of them will ever be garbage. ``gc.freeze()`` moves every
object alive at that moment to a permanent generation that collections skip; objects made later
(per request) are collected as before. Reference counting still frees frozen objects; only
cycles among them wait until they are unfrozen, so the engine unfreezes when the last engine
that froze closes (``gc.unfreeze()`` is process-wide: it also unfreezes what the host froze
itself; such a host sets ``gc_freeze=False``).

A young (generation-0) collection runs every 700 new container objects by default, and a step
at 256 sequences makes thousands: each pass walks the young objects still alive (the step's
rows, outputs and messages), about 0.3 ms a step in all (9% of the loop's CPU at 256
sequences, docs/benchmarks.md "Engine overhead per step"). While an engine runs the threshold is
raised to ``gc_threshold`` (where the host's is lower), and the host's thresholds come back
when the last such engine closes (what the host set meanwhile is overwritten then).
"""

from __future__ import annotations

import gc

_frozen = [0]  # engines that froze and have not closed yet (one event loop: no lock)


def freeze_after_start() -> None:
    """Collect what start-up left as garbage, then freeze everything alive (once per engine)."""
    gc.collect()
    gc.freeze()
    _frozen[0] += 1


_raised: list[int] = [0]  # engines that raised the threshold and have not closed yet
_host_threshold: list[tuple[int, int, int]] = []  # the host's, while raised


def raise_threshold(gen0: int) -> None:
    """Young collections every ``gen0`` new objects at least, while this engine runs (a host
    threshold of 0, automatic collection off, stays 0)."""
    current = gc.get_threshold()
    if _raised[0] == 0:
        _host_threshold[:] = [current]
    _raised[0] += 1
    if 0 < current[0] < gen0:
        gc.set_threshold(gen0, current[1], current[2])


def restore_threshold_at_close() -> None:
    """One engine that raised the threshold has closed; the last one restores the host's."""
    _raised[0] -= 1
    if _raised[0] == 0:
        gc.set_threshold(*_host_threshold.pop())


def unfreeze_at_close() -> None:
    """One engine that froze has closed; the last one hands the frozen objects back to the GC."""
    _frozen[0] -= 1
    if _frozen[0] == 0:
        gc.unfreeze()


class EngineGC:
    """One engine's share of both settings: taken once the engine has started
    (:meth:`start`), given back when it closes (:meth:`close`, which does nothing the second
    time or for what was not taken)."""

    __slots__ = ("_frozen", "_raised")

    def __init__(self) -> None:
        self._frozen = False  # froze at start: unfreezes at close
        self._raised = False  # raised the threshold at start: restores it at close

    def start(self, *, freeze: bool, threshold: int | None) -> None:
        if freeze:  # the model, tokenizer and imports: out of every later GC walk
            freeze_after_start()
            self._frozen = True
        if threshold is not None:  # fewer young collections while steps run
            raise_threshold(threshold)
            self._raised = True

    def close(self) -> None:
        if self._frozen:
            self._frozen = False
            unfreeze_at_close()
        if self._raised:
            self._raised = False
            restore_threshold_at_close()
