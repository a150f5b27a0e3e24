"""Keeping Python's cyclic GC off the host loop's tail latency (``EngineConfig.gc_freeze``).

A generation-2 collection walks every tracked object; after a model, a tokenizer and
transformers are loaded that is hundreds of thousands of them, and each walk stalls the event
loop for 100+ ms although almost none of them will ever be garbage. ``gc.freeze()`` moves every
object alive at that moment to a permanent generation that collections skip; objects made later
(per request) are collected as before. Reference counting still frees frozen objects; only
cycles among them wait until they are unfrozen, so the engine unfreezes when the last engine
that froze closes (``gc.unfreeze()`` is process-wide: it also unfreezes what the host froze
itself; such a host sets ``gc_freeze=False``).
"""

from __future__ import annotations

import gc

_frozen = [0]  # engines that froze and have not closed yet (one event loop: no lock)


def freeze_after_start() -> None:
    """Collect what start-up left as garbage, then freeze everything alive (once per engine)."""
    gc.collect()
    gc.freeze()
    _frozen[0] += 1


def unfreeze_at_close() -> None:
    """One engine that froze has closed; the last one hands the frozen objects back to the GC."""
    _frozen[0] -= 1
    if _frozen[0] == 0:
        gc.unfreeze()
