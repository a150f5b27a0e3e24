"""Imports point down: every module of asyncpaged sits in a layer, and no module imports one of
a higher layer (type-only and deferred imports count, as in ``test_import_cycles``). Modules of
one layer may import each other; the cycle test keeps them from closing a circle.

From the bottom: the parameter and output types, the KV cache's bookkeeping (``kv``) and the
scheduler core over it (``sched``), the models and their kernels, sampling, the worker (the
runner and its tensor-parallel form), what turns tokens into a caller's outputs, the actors,
the engine, and what stands on the engine (server, tools, simulator, the package's front)."""

from __future__ import annotations

import pytest

from tests.test_import_cycles import import_graph

LAYERS: tuple[tuple[str, ...], ...] = (
    ("_log", "_gc", "_detached", "errors"),
    ("spec_decode", "structured_outputs", "tool_choice", "sampling_params", "inputs",
     "outputs", "sampled_token", "config", "lora_request"),
    ("kv",),
    ("sched",),
    ("kernels", "model", "versions"),
    ("sampling",),
    ("worker", "distributed"),
    ("tool_parsers", "reasoning", "reply_parser", "detokenizer", "streams"),
    ("actors",),
    ("engine", "request_checks", "memory_budget"),
    ("server", "tools", "sim", "testing", "default_model", "__main__", ""),
)  # fmt: skip


def layer_of(module: str) -> int:
    """The layer of ``asyncpaged.<top>...`` (``""``: the package itself)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise KeyError(f"{module} is in no layer: add its package or module to LAYERS")


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_imports_point_down() -> None:
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in import_graph().items()
        for d in deps
        if layer_of(d) > layer_of(m)
    )
    assert upward == []


def test_the_check_sees_an_upward_import() -> None:
    assert layer_of("asyncpaged.kv.block_pool") < layer_of("asyncpaged.engine.async_engine")
    with pytest.raises(KeyError):
        layer_of("asyncpaged.nowhere")
