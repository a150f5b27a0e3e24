"""Streaming from an asyncio program, with ``start``/``aclose`` instead of ``async with``.

.venv/bin/python examples/asyncio_streaming.py [--model PATH] [--max-tokens 24]

``await AsyncEngine.start(config)`` returns a running engine whose tasks belong to it, so it can
be closed from any task later (a notebook opens it in one cell and closes it in another).
``RequestOutputKind.DELTA`` yields only the new text of each step.
"""

from __future__ import annotations

import argparse
import asyncio

from asyncpaged import AsyncEngine, EngineConfig, RequestOutputKind, SamplingParams, default_model


async def stream(engine: AsyncEngine, i: int, prompt: str, params: SamplingParams) -> str:
    parts = [prompt]
    async for out in engine.generate(prompt, params):
        parts.append(out.outputs[0].text)
        print(f"[{i}] +{out.outputs[0].text!r}", flush=True)
    return "".join(parts)


async def main(model: str, max_tokens: int) -> None:
    engine = await AsyncEngine.start(EngineConfig(model=model, num_device_blocks=64))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        prompts = ["The return statement", "The import system", "A generator"]
        texts = await asyncio.gather(*(stream(engine, i, p, params) for i, p in enumerate(prompts)))
        for text in texts:
            print(repr(text))
    finally:
        await asyncio.create_task(engine.aclose())  # any task may close it
    print(engine.statistics().num_finished, "requests finished")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF checkpoint (default: the built-in model)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    asyncio.run(main(args.model or str(default_model.path()), args.max_tokens))
