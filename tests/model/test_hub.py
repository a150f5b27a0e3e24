"""Hub ids resolve to snapshots in a Hugging Face cache laid out here (nothing is downloaded)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.model.errors import CheckpointError, UnsupportedModelError
from asyncpaged.model.hub import hub_cache_dir, resolve_model_path
from asyncpaged.model.loader import check_transformers_version

MAIN = "a" * 40
OLD = "b" * 40


def _snapshot(cache: Path, repo: str, commit: str, source: Path, refs: tuple[str, ...]) -> Path:
    """huggingface_hub's layout: models--org--name/{refs/<ref>, snapshots/<commit>/...}."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(
    tmp_path: Path, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> Path:
    cache = tmp_path / "hub"
    _snapshot(cache, "org/tiny", MAIN, tiny_checkpoint("llama-gqa"), ("main",))
    _snapshot(cache, "org/tiny", OLD, tiny_checkpoint("qwen2"), ("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_resolve_to_cached_snapshots(hub_cache: Path) -> None:
    assert hub_cache_dir() == hub_cache
    root = hub_cache / "models--org--tiny" / "snapshots"
    assert resolve_model_path("org/tiny") == root / MAIN
    assert resolve_model_path("org/tiny", revision="v1") == root / OLD
    assert resolve_model_path("org/tiny", revision=OLD) == root / OLD
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE"):
        resolve_model_path("org/missing")
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE"):
        resolve_model_path("org/tiny", revision="no-such-branch")
    with pytest.raises(CheckpointError, match="local directory"):
        resolve_model_path(str(root / MAIN), revision="v1")
    with pytest.raises(CheckpointError, match="not a hub id"):
        resolve_model_path("./no/such/dir/here")


def test_hf_home_is_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / "hub"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_loads_a_hub_id_from_the_cache(hub_cache: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = []
    for revision in (None, "v1"):
        config = EngineConfig(model="org/tiny", revision=revision, dtype="float32")
        async with AsyncEngine(config) as engine:
            assert engine.model_path.parent == hub_cache / "models--org--tiny" / "snapshots"
            with anyio.fail_after(30):
                outputs.append((await engine.generate([5, 6, 7], greedy)).outputs[0].token_ids)
    assert outputs[0] != outputs[1]  # two different checkpoints


def test_old_transformers_is_refused_naming_the_version() -> None:
    check_transformers_version("5.24.0")
    check_transformers_version("6.0.0.dev0")
    with pytest.raises(UnsupportedModelError, match=r"transformers>=5\.0.*found 4\.46\.3"):
        check_transformers_version("4.46.3")
