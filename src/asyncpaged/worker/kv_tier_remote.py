"""The KV tiers with the runner in a process of its own (``executor_backend="process"``).

The tier store copies between the device cache and the host tier, so it lives where the device
cache does: in the runner's process, built there at start (its disk tier scanned there too).
The engine keeps the index (``kv/tiers.py``, in the allocator) and a
:class:`RemoteTierStore`, which sends each transaction's ops down the runner's pipe. The process
runs its requests one at a time in the order sent, so the ops run after the step before them and
before the step after them, as the swap-space actor's thread runs them in one process.

::

   engine process                                  runner process
   start_remote_tiers ── "tiers_build" ──────────► build_kv_tiers(runner.kv_cache, ...)
                     ◄──────────────── TierIndex   (the store stays here)
   swap-space actor ─── "tier_ops" (ops) ────────► KVTierStore.run(ops)
                     ◄──────── failed spills        (hashes whose files were not written)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncpaged.kv.prefix_hash import BlockHash
from asyncpaged.kv.tiers import TierIndex, TierOp
from asyncpaged.worker.kv_tier_store import KVTierStore, build_kv_tiers

if TYPE_CHECKING:
    from asyncpaged.worker.process import RunnerProcess
    from asyncpaged.worker.runner import ModelRunner


class RemoteTierStore:
    """The engine's handle on the tier store in the runner's process.

    Invariants: ops reach the process in the order :meth:`run` is called (one caller at a
    time: the swap-space actor, then the close's persist); a spill the process could not write
    is held here from the reply that reports it until :meth:`take_failed_spills` hands it to
    the allocator.
    """

    def __init__(self, runner: RunnerProcess, *, has_disk: bool) -> None:
        self._runner = runner
        self.has_disk = has_disk
        self._failed_spills: list[BlockHash] = []

    def take_failed_spills(self) -> list[BlockHash]:
        failed, self._failed_spills = self._failed_spills, []
        return failed

    async def run(self, ops: Sequence[TierOp]) -> None:
        """Replay ``ops`` in the process (after every request sent before); raises what the
        store raised there (:class:`~asyncpaged.worker.kv_tier_store.KVTierError`)."""
        failed = await self._runner.call("tier_ops", tuple(ops))
        assert isinstance(failed, list)
        self._failed_spills.extend(failed)


TierStore = KVTierStore | RemoteTierStore


async def start_remote_tiers(
    runner: RunnerProcess,
    *,
    model_path: Path,
    host_bytes: int,
    disk_dir: str | None,
    disk_bytes: int,
) -> tuple[TierIndex, RemoteTierStore]:
    """Build the store in the runner's process; the index for the allocator and the handle."""
    index = await runner.call("tiers_build", (str(model_path), host_bytes, disk_dir, disk_bytes))
    assert isinstance(index, TierIndex)
    return index, RemoteTierStore(runner, has_disk=disk_dir is not None)


def tier_calls(runner: ModelRunner) -> dict[str, Callable[[Any], object]]:
    """The runner process's side: its requests "tiers_build" (once, at start) and
    "tier_ops" (the ops of one transaction; the reply: the spills that failed meanwhile)."""
    stores: list[KVTierStore] = []

    def build(args: tuple[str, int, str | None, int]) -> TierIndex:
        assert not stores, "the KV tiers are built once"
        model_path, host_bytes, disk_dir, disk_bytes = args
        index, store = build_kv_tiers(
            device_cache=runner.kv_cache, model_path=model_path, host_bytes=host_bytes,
            disk_dir=disk_dir, disk_bytes=disk_bytes,
        )  # fmt: skip
        stores.append(store)
        return index

    def run(ops: tuple[TierOp, ...]) -> list[BlockHash]:
        (store,) = stores
        store.run(ops)
        return store.take_failed_spills()

    return {"tiers_build": build, "tier_ops": run}


__all__ = ["RemoteTierStore", "TierStore", "start_remote_tiers", "tier_calls"]
