"""A trio program hosting the engine: concurrent streams in a nursery, a deadline that aborts.

.venv/bin/python examples/trio_host.py [--model PATH] [--max-tokens 24]

The engine runs inside trio's own event loop (through anyio): no thread of its own, no second
loop. Cancelling the task that reads a stream (here ``trio.move_on_after``) aborts that request
and frees its KV blocks within a step; the other streams go on.
"""

from __future__ import annotations

import argparse

import trio

from asyncpaged import AsyncEngine, EngineConfig, RequestOutputKind, SamplingParams, default_model


async def stream(engine: AsyncEngine, name: str, prompt: str, params: SamplingParams) -> None:
    text = ""
    async for out in engine.generate(prompt, params):
        text += out.outputs[0].text
    print(f"[{name}] {prompt}{text!r} ({out.outputs[0].finish_reason})")


async def main(model: str, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    async with AsyncEngine(EngineConfig(model=model, num_device_blocks=64)) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, engine, "a", "The return statement", params)
            nursery.start_soon(stream, engine, "b", "A list comprehension", params)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        with trio.move_on_after(0.05):  # the deadline cancels the read: the request is aborted
            await engine.generate("The with statement", long)
        await engine.wait_idle()
        stats = engine.statistics()
        print(f"aborted {stats.num_aborted}, free blocks {stats.num_free_device_blocks}"
              f"/{stats.num_device_blocks}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF checkpoint (default: the built-in model)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    trio.run(main, args.model or str(default_model.path()), args.max_tokens)
