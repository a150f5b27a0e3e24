"""``engine.statistics()``: one immutable snapshot of the engine's counters.

The counters live with their owners (the block pool's snapshot, the scheduler core, the
scheduler and intake actors); this module only reads them into :class:`EngineStatistics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncpaged.actors.intake import IntakeActor
    from asyncpaged.actors.scheduler import SchedulerActor

__all__ = ["EngineStatistics", "collect_statistics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStatistics:
    """A snapshot of the engine's counters (see docs/api.md for each field)."""

    num_device_blocks: int
    num_free_device_blocks: int
    num_host_blocks: int
    num_free_host_blocks: int
    num_cached_device_blocks: int
    num_shared_device_blocks: int
    num_filled_device_slots: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_swap_outs: int
    num_swap_ins: int
    num_recomputes: int
    num_rope_restarts: int
    num_cow_copies: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_finished: int
    num_aborted: int
    num_steps: int
    step_time_s: float
    compute_time_s: float
    num_jump_forward_tokens: int = 0  # structured outputs: tokens appended without sampling
    # Async scheduling: steps planned while the one before ran, and their rows computed in
    # vain (the step before ended the sequence with a stop token, or a grammar forced the
    # tokens after its token: the sample planned ahead was discarded)
    num_steps_planned_ahead: int = 0
    num_discarded_rows: int = 0
    num_cuda_graph_steps: int = 0  # steps whose forward replayed a CUDA graph (decodes, CUDA)
    # Prefix-cache hit tokens by tier (they sum to prefix_cache_hit_tokens) and KV-tier copies
    prefix_cache_device_hit_tokens: int = 0
    prefix_cache_host_hit_tokens: int = 0
    prefix_cache_disk_hit_tokens: int = 0
    num_kv_offloads: int = 0  # evicted device blocks copied to the host tier
    num_kv_spills: int = 0  # host-tier blocks written to the disk tier
    # Speculative decoding (vLLM's names): verification rounds with proposals, tokens proposed
    # and accepted, and per position j the share of rounds proposing > j tokens whose first
    # j + 1 were all accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_acceptance_by_position: tuple[float, ...] = ()
    num_lora_loads: int = 0  # LoRA adapters put into a device slot (the slots' LRU misses)


def collect_statistics(actor: SchedulerActor, intake: IntakeActor) -> EngineStatistics:
    """The counters as of the scheduler actor's last step (its pool snapshot)."""
    pool = actor.snapshot.statistics
    sched = actor.statistics()
    spec = actor.scheduler.spec_stats
    return EngineStatistics(
        num_device_blocks=pool.device.total,
        num_free_device_blocks=pool.device.free + pool.device.cached,
        num_host_blocks=pool.host.total,
        num_free_host_blocks=pool.host.free,
        num_cached_device_blocks=pool.device.cached,
        num_shared_device_blocks=pool.num_shared_device_blocks,
        num_filled_device_slots=pool.num_filled_device_slots,
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        num_swapped=sched.num_swapped,
        num_preemptions=sched.num_preemptions,
        num_swap_outs=sched.num_swap_outs,
        num_swap_ins=sched.num_swap_ins,
        num_recomputes=sched.num_recomputes,
        num_rope_restarts=sched.num_rope_restarts,
        num_cow_copies=pool.num_cow_copies,
        prefix_cache_query_tokens=pool.prefix_query_tokens,
        prefix_cache_hit_tokens=pool.prefix_hit_tokens,
        num_finished=sched.num_finished,
        num_aborted=sched.num_aborted + intake.num_aborted,
        num_steps=actor.num_steps,
        step_time_s=actor.step_time_s,
        compute_time_s=actor.compute_time_s,
        num_jump_forward_tokens=actor.num_jump_forward_tokens,
        num_steps_planned_ahead=actor.num_steps_ahead,
        num_discarded_rows=actor.scheduler.num_discarded_rows,
        num_cuda_graph_steps=actor.num_steps_graphed,
        prefix_cache_device_hit_tokens=pool.prefix_hit_tokens
        - pool.prefix_host_hit_tokens
        - pool.prefix_disk_hit_tokens,
        prefix_cache_host_hit_tokens=pool.prefix_host_hit_tokens,
        prefix_cache_disk_hit_tokens=pool.prefix_disk_hit_tokens,
        num_kv_offloads=pool.num_tier_offloads,
        num_kv_spills=pool.num_tier_spills,
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        spec_acceptance_by_position=spec.acceptance_rate_by_position,
        num_lora_loads=actor.num_lora_loads,
    )
