"""What rank 0 tells the other tensor-parallel ranks, in order, over the control group.

::

    rank 0                                   rank r (1 .. N-1)
    WorkerSpec ──────── once, at start ────► build its ModelRunner shard
     (with the log level)
               ◄─────── WorkerReady ──────── (gathered: pid, KV bytes, or the load error,
                                              and the library's log events of the load)
    RunStep ─────────── every step ────────► execute_forward (all-reduces pair with rank 0's)
    SwapCommand ─────── every swap ────────► swap_out / swap_in of its share of the blocks
    Shutdown ────────── at close ──────────► leave the loop, destroy the group, exit

Commands are frozen dataclasses of numbers and tuples, pickled by
``torch.distributed.broadcast_object_list``. A step carries only what a non-sampling rank reads:
per sequence the new tokens, the cached-token count, the slot mapping and the block table's
changes since the last step (``worker/input_batch``: every rank's runner keeps the tables, and
every rank runs every step, in order), plus the copy-on-write pairs; sampling options stay on
rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from asyncpaged.kv.block_table import PLACEHOLDER_TOKEN, SwapDirection
from asyncpaged.worker.protocol import SequenceStep, StepPlan
from asyncpaged.worker.runner_logs import LogBatch

# (seq_id, token_ids, num_computed_tokens, slot_mapping, table_start, block_table,
# min_rope_len): the table from entry table_start on, as the plan has it (each rank keeps its
# own persistent tables); what every rank's forward reads of a row
WireSequence = tuple[int, tuple[int, ...], int, tuple[int, ...], int, tuple[int, ...], int]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerReady:
    """A rank's reply to the spec: its KV cache bytes, or the error that stopped its load;
    the library's log events of its load (rank 0 emits them in the engine's process)."""

    rank: int
    pid: int
    kv_cache_bytes: int = 0
    host_kv_cache_bytes: int = 0
    num_kv_heads: int = 0
    error: BaseException | None = None
    logs: LogBatch | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStep:
    """Run the forward of one step (copy-on-write pairs first)."""

    seqs: tuple[WireSequence, ...]
    copy_pairs: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, plan: StepPlan, placeholder_values: Callable[[], dict[int, int]]) -> RunStep:
        """``placeholder_values()``: what rank 0 sampled last, by sequence, for the rows planned
        ahead of it (async scheduling: their input is a ``PLACEHOLDER_TOKEN`` that only rank 0,
        which samples, can fill in)."""
        late: dict[int, int] | None = None
        seqs = []
        for s in plan.seqs:
            tokens = s.token_ids
            if tokens[-1] == PLACEHOLDER_TOKEN:  # a late row has that one token
                late = placeholder_values() if late is None else late
                tokens = (late[s.seq_id],)
            seqs.append((s.seq_id, tokens, s.num_computed_tokens, s.slot_mapping,
                         s.table_start, s.block_table, s.min_rope_len))  # fmt: skip
        return cls(seqs=tuple(seqs), copy_pairs=plan.copy_pairs)

    def plan(self) -> StepPlan:
        """The step as a plan that samples nothing (what a rank other than 0 runs)."""
        seqs = tuple(
            SequenceStep(seq_id=seq_id, token_ids=tokens, num_computed_tokens=computed,
                         slot_mapping=slots, block_table=table, do_sample=False,
                         table_start=start, min_rope_len=rope)
            for seq_id, tokens, computed, slots, start, table, rope in self.seqs
        )  # fmt: skip
        return StepPlan(seqs=seqs, copy_pairs=self.copy_pairs)


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapCommand:
    """Copy blocks between this rank's device and host caches: (device, host) pairs for OUT,
    (host, device) pairs for IN, as in ``SwapPlan.block_mapping``."""

    direction: SwapDirection
    pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CaptureGraphs:
    """Capture the decode forward's graphs for these batch sizes, as rank 0 does at the same
    time (``worker/cuda_graphs.py``); ``eager``: the eager stand-in instead of CUDA graphs."""

    sizes: tuple[int, ...]
    max_model_len: int
    eager: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphsCaptured:
    """A rank's reply to :class:`CaptureGraphs`: the sizes it captured and the library's log
    events of the capture (rank 0 emits them in the engine's process). A rank whose capture
    raises exits instead (its peers may wait in a capture's all-reduce)."""

    rank: int
    sizes: tuple[int, ...]
    logs: LogBatch | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown:
    """Leave the worker loop."""


Command = RunStep | SwapCommand | CaptureGraphs | Shutdown
