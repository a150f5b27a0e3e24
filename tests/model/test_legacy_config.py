"""Configs as they sit on disk today: the legacy ``rope_theta`` / ``rope_scaling`` fields of hub
``config.json`` files (and transformers 4 config objects) give the same rotation as
transformers 5's ``rope_parameters``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncpaged.model.rotary import rope_parameters
from tests.model.driver import Driver
from tests.model.reference import HFReference
from tests.model.test_generate_equality import _assert_matches, _make_sequences, _runner


def test_legacy_rope_fields_in_config_json_load_and_match_transformers(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A hub-style config.json (``rope_theta`` + ``rope_scaling`` with the old ``type`` key)
    through the loader: the same greedy tokens and logprobs as transformers on that file."""
    dst = tmp_path / "legacy"
    shutil.copytree(tiny_checkpoint("llama-gqa"), dst)
    config = json.loads((dst / "config.json").read_text())
    del config["rope_parameters"]
    config["rope_theta"] = 500.0  # far from the default 10000: a dropped field shows
    config["rope_scaling"] = {"type": "linear", "factor": 3.0}
    (dst / "config.json").write_text(json.dumps(config))
    runner = _runner(dst)
    params = runner.model.rotary.params  # type: ignore[union-attr]
    assert (params["rope_type"], params["rope_theta"], params["factor"]) == ("linear", 500.0, 3.0)
    seqs = _make_sequences(seed=12)
    Driver(runner, seed=3).run(seqs)
    _assert_matches(seqs, HFReference(dst))


@pytest.mark.parametrize(
    ("legacy", "v5"),
    [
        ({"rope_theta": 5e5, "rope_scaling": None}, {"rope_type": "default", "rope_theta": 5e5}),
        (
            {"rope_theta": 1e4, "rope_scaling": {"type": "su", "short_factor": [1.0]}},
            {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]},
        ),
        (
            {"rope_theta": 1e4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
        ),
        ({"rope_theta": 1e4, "partial_rotary_factor": 0.5},
         {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    ],
)  # fmt: skip
def test_transformers4_config_objects(legacy: dict[str, object], v5: dict[str, object]) -> None:
    """A transformers-4 config object (no ``rope_parameters``) reads like transformers 5's."""
    got = rope_parameters(SimpleNamespace(**legacy))
    assert {k: got[k] for k in v5} == v5
    got.pop("type", None)
    assert set(got) == set(v5)


def test_gemma3_legacy_local_rope_base() -> None:
    legacy = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4,
                             rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    assert rope_parameters(legacy, "sliding_attention") == {
        "rope_type": "default",
        "rope_theta": 1e4,
    }
    full = rope_parameters(legacy, "full_attention")
    assert (full["rope_type"], full["rope_theta"], full["factor"]) == ("linear", 1e6, 8.0)
    import transformers

    v5 = transformers.Gemma3TextConfig(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    for layer_type in ("sliding_attention", "full_attention"):
        assert rope_parameters(v5, layer_type) == rope_parameters(legacy, layer_type)
