"""The last steps of an engine's start, for :class:`AsyncEngine`, once its model,
tokenizers and KV tiers are loaded (``engine.build``): the block pool, the scheduler core and
the actors over them, the order the actors start in, and the start logged.
"""

from __future__ import annotations

from collections.abc import Iterator

from asyncpaged._log import get_logger
from asyncpaged.actors.draft_proposals import DraftProposals
from asyncpaged.config import EngineConfig
from asyncpaged.engine.build import (
    EngineActors,
    ModelPlan,
    Proposer,
    Tokenizers,
    build_actors,
    build_scheduler,
)
from asyncpaged.engine.lifecycle import ActorRun
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.kv.tiers import TierIndex
from asyncpaged.worker.kv_tier_remote import TierStore
from asyncpaged.worker.process import RunnerProcess
from asyncpaged.worker.protocol import StepRunner

__all__ = ["actor_runs", "build_engine_actors", "log_started"]

log = get_logger("asyncpaged.engine")  # its events are the engine's


def build_engine_actors(
    cfg: EngineConfig,
    plan: ModelPlan,
    runner: StepRunner | RunnerProcess,
    *,
    rope_switch_len: int | None,
    tiers: TierIndex | None,
    tokenizers: Tokenizers,
    seq_ids: Iterator[int],
    tier_store: TierStore | None,
    propose: Proposer | None,
    draft_proposals: DraftProposals | None,
) -> EngineActors:
    """The block pool (over the KV tiers' index), the scheduler core (new sequence ids from
    ``seq_ids``, shared with the intake; speculation through ``propose``) and the actors over
    them, none started yet."""
    num_device, num_host = plan.num_device_blocks, plan.num_host_blocks
    pool = BlockPool(num_device, num_host, block_size=cfg.block_size,
                     enable_prefix_caching=cfg.enable_prefix_caching, tiers=tiers)  # fmt: skip
    scheduler = build_scheduler(cfg, num_device, num_host, rope_switch_len, seq_ids.__next__,
                                propose)  # fmt: skip
    return build_actors(
        cfg, pool, scheduler, runner, tokenizer=tokenizers.tokenizer,
        intake_tokenizer=tokenizers.intake_tokenizer, limits=tokenizers.limits, seq_ids=seq_ids,
        tier_store=tier_store, draft_proposals=draft_proposals, reasoning=tokenizers.reasoning,
    )  # fmt: skip


def actor_runs(actors: EngineActors) -> list[ActorRun]:
    """The actors' ``run``, in the order they start."""
    return [actor.run for actor in (actors.allocator, actors.executor, actors.swap_space,
                                    actors.outputs, actors.scheduler, actors.intake)]  # fmt: skip


def log_started(cfg: EngineConfig, plan: ModelPlan) -> None:
    """The ``engine_started`` event, once the engine runs."""
    log.info("engine_started", model=cfg.model, num_device_blocks=plan.num_device_blocks,
             num_host_blocks=plan.num_host_blocks, dtype=str(plan.dtype),
             kv_cache_dtype=str(plan.kv_dtype),
             tensor_parallel_size=cfg.tensor_parallel_size)  # fmt: skip
