"""Triton is the ``cuda`` extra: without it, asyncpaged imports and generates on CPU."""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as if not installed

import anyio
import asyncpaged
from asyncpaged import AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from asyncpaged import default_model
from asyncpaged.worker.runner import select_attention_backend

async def main() -> None:
    config = EngineConfig(model=str(default_model.path()), num_device_blocks=32)
    async with AsyncEngine(config) as engine:
        out = await engine.generate("The return", SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 4, out

anyio.run(main)
try:
    select_attention_backend("cpu", "triton")
except InvalidRequestError as exc:
    assert "asyncpaged[cuda]" in str(exc), exc
else:
    raise AssertionError("the triton backend was made without triton")
loaded = [name for name, module in sys.modules.items()
          if name.split(".")[0] == "triton" and module is not None]
assert not loaded, loaded
print("generated without triton")
"""


def test_import_and_cpu_generate_without_triton() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "generated without triton\n"
