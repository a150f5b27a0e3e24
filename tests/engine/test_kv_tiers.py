"""The KV tiers end to end: host-tier hits, a restart that hits the disk tier, and the disk
entries that must be misses (corrupted, truncated, another model, a full disk), each with
greedy tokens identical to a run without tiers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import (
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    SamplingParams,
)
from asyncpaged.kv.prefix_hash import hash_full_blocks
from asyncpaged.testing.tiny_models import build_tiny_checkpoint
from asyncpaged.worker import kv_tier_store
from asyncpaged.worker.kv_tier_store import HEADER, KVTierError, KVTierStore
from asyncpaged.worker.protocol import StepPlan
from asyncpaged.worker.runner import ModelRunner
from tests.engine.conftest import running_engine
from tests.engine.test_async_mix import assert_same, mixed_params, run_mix

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 16
PREFIX_LEN = 1000
NUM_PREFIX_BLOCKS = PREFIX_LEN // BS  # 62 full blocks

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GQA Llama with room for 1,000-token prompts (default RoPE extends as is)."""
    path = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("long-llama"))
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 2048
    config_path.write_text(json.dumps(config))
    return path


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


PREFIX = tokens(0, PREFIX_LEN)
FLUSH = [tokens(1, PREFIX_LEN + 10), tokens(2, PREFIX_LEN + 10)]
SECOND = [*PREFIX, 7, 8, 9]


def engine_config(**kw: Any) -> dict[str, Any]:
    # 70 device blocks: one 1,000-token request at a time, and two others evict all of it.
    base: dict[str, Any] = {"num_device_blocks": 70, "max_num_batched_tokens": 2048,
                                "attention_backend": "torch"}  # fmt: skip
    base.update(kw)
    return base


async def run_turns(path: Path, prompts: list[list[int]], **kw: Any) -> tuple[list[list[int]], Any]:
    with anyio.fail_after(120):
        async with running_engine(path, **engine_config(**kw)) as engine:
            outs = [list((await engine.generate(p, GREEDY)).outputs[0].token_ids) for p in prompts]
            stats = engine.statistics()
    return outs, stats


@pytest.fixture(scope="module")
def no_tier_tokens(long_llama: Path) -> list[int]:
    async def main() -> list[int]:
        outs, stats = await run_turns(long_llama, [SECOND])
        assert stats.prefix_cache_hit_tokens == 0
        return outs[0]

    return anyio.run(main)


# The tier store lives beside the device cache: in this process, or in the runner's own
# (worker/kv_tier_remote.py), where its ops go down the runner's pipe.
BACKENDS = pytest.mark.parametrize("backend", ["thread", "process"])


@BACKENDS
async def test_host_tier_serves_a_prefix_the_device_evicted(
    backend: str, long_llama: Path, no_tier_tokens: list[int]
) -> None:
    outs, stats = await run_turns(
        long_llama, [[*PREFIX, 5], FLUSH[0], SECOND], kv_offload_host_bytes=1 << 20,
        executor_backend=backend,
    )  # fmt: skip
    assert outs[2] == no_tier_tokens
    # The device kept the prefix's head (the LRU evicts tails first), the host tier the rest.
    assert stats.prefix_cache_host_hit_tokens > 0
    assert stats.prefix_cache_device_hit_tokens > 0
    hits = stats.prefix_cache_host_hit_tokens + stats.prefix_cache_device_hit_tokens
    assert hits == NUM_PREFIX_BLOCKS * BS
    assert stats.prefix_cache_disk_hit_tokens == 0
    assert stats.num_kv_offloads > 0


async def test_without_tiers_the_evicted_prefix_is_recomputed(long_llama: Path) -> None:
    _, stats = await run_turns(long_llama, [[*PREFIX, 5], FLUSH[0], SECOND])
    assert stats.prefix_cache_hit_tokens < NUM_PREFIX_BLOCKS * BS
    assert stats.prefix_cache_host_hit_tokens == 0


def disk_kw(directory: Path, entries: int = 400) -> dict[str, Any]:
    entry = HEADER.size + 2 * 2 * 2 * 16 * BS * 4  # layers x K/V x kv heads x head dim x bs x fp32
    return {"kv_offload_host_bytes": 8 * 4096, "kv_offload_dir": str(directory),
                "kv_offload_disk_bytes": entries * entry}  # fmt: skip


async def fill_disk(path: Path, directory: Path, **kw: Any) -> None:
    """One engine computes the prefix, then two others push it down to the disk tier."""
    _, stats = await run_turns(path, [[*PREFIX, 5], *FLUSH], **disk_kw(directory), **kw)
    assert stats.num_kv_spills >= NUM_PREFIX_BLOCKS


def block_file(directory: Path, index: int) -> Path:
    """The entry of the prefix's block ``index`` (the directory holds one model's folder)."""
    (model_dir,) = directory.iterdir()
    block_hash = hash_full_blocks(PREFIX, BS, None, index + 1)[index]
    return model_dir / f"{block_hash.hex()}.kv"


async def test_close_writes_the_cached_blocks_to_disk(
    long_llama: Path, no_tier_tokens: list[int], tmp_path: Path
) -> None:
    """Nothing was evicted: the prefix was still on the device when the engine closed."""
    _, stats = await run_turns(long_llama, [[*PREFIX, 5]], **disk_kw(tmp_path))
    assert stats.num_kv_offloads == 0
    outs, stats = await run_turns(long_llama, [SECOND], **disk_kw(tmp_path))
    assert outs[0] == no_tier_tokens
    assert stats.prefix_cache_disk_hit_tokens == NUM_PREFIX_BLOCKS * BS


@BACKENDS
async def test_restart_hits_the_disk_tier(
    backend: str, long_llama: Path, no_tier_tokens: list[int], tmp_path: Path
) -> None:
    await fill_disk(long_llama, tmp_path, executor_backend=backend)
    assert all(block_file(tmp_path, i).exists() for i in range(NUM_PREFIX_BLOCKS))
    outs, stats = await run_turns(
        long_llama, [SECOND], **disk_kw(tmp_path), executor_backend=backend
    )
    assert outs[0] == no_tier_tokens
    assert stats.prefix_cache_disk_hit_tokens == NUM_PREFIX_BLOCKS * BS
    assert stats.prefix_cache_device_hit_tokens == stats.prefix_cache_host_hit_tokens == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate-header"])
async def test_a_damaged_entry_is_a_miss(
    damage: str, long_llama: Path, no_tier_tokens: list[int], tmp_path: Path
) -> None:
    await fill_disk(long_llama, tmp_path)
    victim = block_file(tmp_path, 5)
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[HEADER.size + 100] ^= 0x40
    elif damage == "truncate":
        data = data[:-1]
    else:
        data = data[:20]
    victim.write_bytes(bytes(data))
    outs, stats = await run_turns(long_llama, [SECOND], **disk_kw(tmp_path))
    assert outs[0] == no_tier_tokens
    # The chain stops at the damaged block: blocks 0-4 came from disk, the rest recomputed.
    assert stats.prefix_cache_disk_hit_tokens == 5 * BS
    assert not victim.exists() or victim.read_bytes() != bytes(data)  # dropped or rewritten


@BACKENDS
async def test_a_dropped_entry_is_logged_through_the_engines_process(
    backend: str, long_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk scan runs where the store lives; from the runner's process its warning
    reaches the engine's process as a record of the same logger, with its structure and the
    runner's pid (worker/runner_logs.py), so the host's handlers see it there."""
    await fill_disk(long_llama, tmp_path)
    victim = block_file(tmp_path, 5)
    victim.write_bytes(victim.read_bytes()[:20])
    with caplog.at_level(logging.WARNING, logger="asyncpaged"):
        await run_turns(long_llama, [SECOND], **disk_kw(tmp_path), executor_backend=backend)
    dropped = [r for r in caplog.records if getattr(r, "event", None) == "kv_tier_entry_dropped"]
    assert len(dropped) == 1, caplog.records
    assert dropped[0].name == "asyncpaged.worker.kv_tier_store"
    assert dropped[0].levelno == logging.WARNING
    assert dropped[0].event_fields == {"path": str(victim), "reason": "corrupt"}
    assert (dropped[0].process != os.getpid()) == (backend == "process")


async def test_another_model_never_reads_the_entries(
    long_llama: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    await fill_disk(long_llama, tmp_path)
    other = tmp_path_factory.mktemp("other-llama")
    shutil.copytree(long_llama, other, dirs_exist_ok=True)
    build_tiny_checkpoint("llama-gqa", other / "weights", seed=1)  # new weights, same shapes
    shutil.copy(other / "weights" / "model.safetensors", other / "model.safetensors")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.kv")}
    reference, _ = await run_turns(other, [SECOND])
    outs, stats = await run_turns(other, [SECOND], **disk_kw(tmp_path))
    assert outs == reference
    assert stats.prefix_cache_disk_hit_tokens == 0
    after = {p: p.read_bytes() for p in tmp_path.rglob("*.kv") if p in before}
    assert after == before  # the first model's entries are left as they were
    assert len(list(tmp_path.iterdir())) == 2  # the other model wrote its own folder


async def test_the_disk_budget_is_never_exceeded(long_llama: Path, tmp_path: Path) -> None:
    kw = disk_kw(tmp_path, entries=10)
    _, stats = await run_turns(long_llama, [[*PREFIX, 5], *FLUSH], **kw)
    files = list(tmp_path.rglob("*.kv"))
    assert stats.num_kv_spills > 10
    assert len(files) == 10
    assert sum(f.stat().st_size for f in files) <= kw["kv_offload_disk_bytes"]
    assert not list(tmp_path.rglob("*.tmp"))


async def test_a_full_disk_is_a_miss(
    long_llama: Path, no_tier_tokens: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("asyncpaged.worker.kv_tier_store.os.replace", no_space)
    # Same engine: the spilled blocks are never restored; SECOND hits only what stayed above.
    prompts = [[*PREFIX, 5], *FLUSH, SECOND]
    outs, stats = await run_turns(long_llama, prompts, **disk_kw(tmp_path))
    assert outs[3] == no_tier_tokens
    assert stats.num_kv_spills > 0
    assert stats.prefix_cache_disk_hit_tokens == 0
    assert not list(tmp_path.rglob("*.*"))


@BACKENDS
async def test_a_removed_directory_is_a_miss(
    backend: str, long_llama: Path, no_tier_tokens: list[int], tmp_path: Path
) -> None:
    """The tier's folder removed under the running engine: every spill fails, and the store
    reports it (from the runner's process too) before anything could restore the block; a
    spill taken as written would fail the engine (KVTierError) at SECOND's restore."""
    with anyio.fail_after(120):
        config = engine_config(**disk_kw(tmp_path), executor_backend=backend)
        async with running_engine(long_llama, **config) as engine:
            shutil.rmtree(tmp_path)
            for prompt in ([*PREFIX, 5], *FLUSH):
                await engine.generate(prompt, GREEDY)
            out = await engine.generate(SECOND, GREEDY)
            stats = engine.statistics()
    assert list(out.outputs[0].token_ids) == no_tier_tokens
    assert stats.num_kv_spills > 0
    assert stats.prefix_cache_disk_hit_tokens == 0


@BACKENDS
async def test_an_entry_gone_after_the_scan_fails_the_engine(
    backend: str, long_llama: Path, tmp_path: Path
) -> None:
    """An entry verified at start that no longer reads back at its restore (deleted under
    the running engine) fails the engine, never computes with wrong K/V: every waiter hears
    ``EngineDeadError`` caused by ``KVTierError``, raised in the runner's process too."""
    await fill_disk(long_llama, tmp_path, executor_backend=backend)
    kw = engine_config(**disk_kw(tmp_path), executor_backend=backend)
    config = EngineConfig(model=str(long_llama), dtype="float32", **kw)
    with anyio.fail_after(120), pytest.raises(EngineDeadError) as info:
        async with AsyncEngine(config) as engine:
            block_file(tmp_path, 5).unlink()
            await engine.generate(SECOND, GREEDY)
    assert isinstance(info.value.__cause__, KVTierError), info.value.__cause__


def test_disk_entries_round_trip_and_reject_other_identities(tmp_path: Path) -> None:
    disk = kv_tier_store.DiskTier(tmp_path, b"\x01" * 32, payload_bytes=64)
    h = bytes(range(32))
    assert disk.write(h, bytes(range(64)))
    assert disk.read(h) == bytes(range(64))
    assert disk.scan(10) == [h]
    other = kv_tier_store.DiskTier(tmp_path, b"\x02" * 32, payload_bytes=64)
    assert other.directory != disk.directory
    shutil.copy(disk.path(h), other.path(h))  # a file moved into another model's folder
    assert other.read(h) is None  # its header names the first model
    assert other.scan(10) == []
    assert other.path(h).exists()  # not ours: left in place
    assert disk.scan(0) == []  # over the budget: dropped
    assert not disk.path(h).exists()


def test_an_nhd_cache_keeps_its_layout_through_the_tiers(tmp_path: Path) -> None:
    """The host tier copies the device cache's layout (its blocks are swapped whole), a block's
    bytes load back in place, and the disk identity names the "nhd" layout (the runner
    layout's identity is what it was before layouts existed: no new key in its document)."""
    from asyncpaged.model.kv_cache import PagedKVCache

    shape = {"num_layers": 2, "num_blocks": 4, "block_size": 16, "num_kv_heads": 2,
             "head_dim": 8, "dtype": torch.float32}  # fmt: skip
    device = PagedKVCache(**shape, layout="nhd")  # type: ignore[arg-type]
    device.key.normal_()
    device.value.normal_()
    store = KVTierStore(device, num_host_slots=2)
    assert store.host.layout == "nhd"
    payload = kv_tier_store.block_bytes(device, 1)
    want = device.key[:, 1].clone(), device.value[:, 1].clone()
    kv_tier_store.load_block(device, 3, payload)
    assert torch.equal(device.key[:, 3], want[0]) and torch.equal(device.value[:, 3], want[1])
    (tmp_path / "config.json").write_text("{}")
    ident = partial(kv_tier_store.model_identity, tmp_path, torch.float32, 16, (2, 2, 8))
    assert ident() == ident("runner") != ident("nhd")
    doc = {"format": kv_tier_store.FORMAT_VERSION, "model": str(tmp_path.resolve()),
           "config_sha256": hashlib.sha256(b"{}").hexdigest(), "weights": [],
           "kv_dtype": "torch.float32", "block_size": 16, "kv_shape": [2, 2, 8]}  # fmt: skip
    assert ident() == hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()


async def _turns_ahead(
    path: Path, ahead: bool, monkeypatch: pytest.MonkeyPatch, backend: str = "thread"
) -> tuple[list[list[int]], Any, list[bool]]:
    """The prefix, a stream aborted while steps run ahead (its blocks freed with a row in
    flight), two flushes and the prefix again, on the runner's thread (or in its process);
    whether a step was executing at each KV-tier copy (seen only on the thread)."""
    executing = [False]
    during_copy: list[bool] = []
    execute, run_ops = ModelRunner.execute, KVTierStore.run

    def timed_execute(self: ModelRunner, plan: StepPlan) -> Any:
        executing[0] = True
        try:
            return execute(self, plan)
        finally:
            executing[0] = False

    def watched_run(self: KVTierStore, ops: Any) -> None:
        during_copy.append(executing[0])
        run_ops(self, ops)

    monkeypatch.setattr(ModelRunner, "execute", timed_execute)
    monkeypatch.setattr(KVTierStore, "run", watched_run)
    longer = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = engine_config(kv_offload_host_bytes=1 << 20, async_scheduling=ahead,
                           executor_backend=backend)  # fmt: skip
    with anyio.fail_after(180):
        async with running_engine(path, **config) as engine:
            outs = [list((await engine.generate([*PREFIX, 5], longer)).outputs[0].token_ids)]
            async for out in engine.generate(tokens(3, 600), longer):
                if len(out.outputs[0].token_ids) >= 3:
                    break  # closed: aborted with the next steps planned
            for prompt in (*FLUSH, SECOND):
                outs.append(list((await engine.generate(prompt, longer)).outputs[0].token_ids))
            stats = engine.statistics()
    return outs, stats, during_copy


async def test_async_scheduling_orders_tier_copies_after_the_step_in_flight(
    long_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling the KV tiers' copies of a plan made ahead wait for the step in
    flight (a block it writes may have been freed and be offloaded or restored into): no
    copy runs while a step executes. Greedy tokens equal the run without it, with offloads
    and host-tier hits in both."""
    runs = {ahead: await _turns_ahead(long_llama, ahead, monkeypatch) for ahead in (False, True)}
    assert runs[True][0] == runs[False][0]
    for ahead, (_, stats, during_copy) in runs.items():
        assert stats.num_kv_offloads > 0, stats
        assert stats.prefix_cache_host_hit_tokens > 0, stats
        assert during_copy, "no tier copies"
        assert not any(during_copy), f"a tier copy while a step ran (ahead={ahead})"
        assert (stats.num_steps_planned_ahead > 0) == ahead, stats


async def test_the_runner_process_with_async_scheduling(
    long_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's process plans ahead with the KV tiers (their ops go down its pipe after
    the step in flight): greedy tokens equal the sync thread's, with offloads, host-tier hits
    and steps planned ahead; an aborted stream frees its blocks (the leak oracle)."""
    sync = await _turns_ahead(long_llama, False, monkeypatch)
    ahead = await _turns_ahead(long_llama, True, monkeypatch, backend="process")
    assert ahead[0] == sync[0]
    for _, stats, _ in (sync, ahead):
        assert stats.num_kv_offloads > 0, stats
        assert stats.prefix_cache_host_hit_tokens > 0, stats
    assert sync[1].num_steps_planned_ahead == 0 < ahead[1].num_steps_planned_ahead


async def test_a_random_mix_over_shared_prefixes_in_the_runner_process(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Random requests (tests/engine/test_async_mix.py's menu, logprobs left out: a prefix
    hit changes the summation order, and a rank may swap at a near-tie) over three shared
    prompt heads, at once: with the KV tiers in the runner's process, async scheduling and
    swap preemption in 16 device blocks, the outputs equal the sync thread engine's without
    tiers, with offloads, tier hits and preemptions on the way."""
    rng = random.Random(15)
    heads = [[rng.randrange(3, 200) for _ in range(n)] for n in (32, 40, 64)]
    prompts = [(*rng.choice(heads), *tokens(100 + i, rng.randrange(1, 12))) for i in range(28)]
    params = [dataclasses.replace(mixed_params(rng, i), logprobs=None, prompt_logprobs=None)
              for i in range(28)]  # fmt: skip
    path = tiny_checkpoint("llama-gqa")
    sync, _ = await run_mix(path, prompts, params.__getitem__, **engine_config(
        async_scheduling=False, executor_backend="thread", num_device_blocks=256,
    ))  # fmt: skip
    outs, stats = await run_mix(path, prompts, params.__getitem__, **engine_config(
        async_scheduling=True, executor_backend="process", num_device_blocks=16,
        preemption_mode="swap",
        **(disk_kw(tmp_path, entries=4) | {"kv_offload_host_bytes": 4 * 8192}),
    ))  # fmt: skip
    for i, (old, new) in enumerate(zip(sync, outs, strict=True)):
        assert_same(old, new, i)
    assert stats.num_kv_offloads > 0 and stats.num_kv_spills > 0, stats
    assert stats.prefix_cache_host_hit_tokens + stats.prefix_cache_disk_hit_tokens > 0, stats
    assert stats.num_preemptions > 0 and stats.num_steps_planned_ahead > 0, stats
