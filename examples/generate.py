"""Stream a few concurrent generations from a checkpoint (default: a tiny random Llama).

.venv/bin/python examples/generate.py [--model PATH]
"""

from __future__ import annotations

import argparse
import tempfile

import anyio

from asyncpaged import AsyncEngine, EngineConfig, RequestOutputKind, SamplingParams


async def main(model: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, output_kind=RequestOutputKind.DELTA)
    prompts = ["The block table", "Paged attention", "A sequence group"]
    async with AsyncEngine(EngineConfig(model=model, num_device_blocks=64)) as engine:

        async def stream(i: int) -> None:
            async for out in engine.generate(prompts[i], params):
                print(f"[{i}] {out.outputs[0].text!r}", flush=True)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(stream, i)
        print(engine.statistics())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="an HF checkpoint directory")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from asyncpaged.testing.tiny_models import build_tiny_checkpoint

        model = str(build_tiny_checkpoint("llama-gqa", tempfile.mkdtemp()))
    anyio.run(main, model)
