"""A finished request's blocks are back in the pool before its final output reaches its reader.

Right after the last ``await generate()`` returns (no ``wait_idle``, no sleep), the statistics
must show every device block free or cached: the scheduler actor frees what finished in the
transaction planned right after the step, and records (and shows) outputs only after it. A
stop string is found while detokenizing, so those requests are detokenized before the next
plan and held from their readers until the transaction is done. Both preemption modes, both
kinds of readers (``await`` and DELTA streams), with and without async scheduling (a request
finished while the next step runs is freed in a transaction of its own when that step could
not be planned ahead). TP=2 is checked in
tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncpaged import RequestOutput, RequestOutputKind, SamplingParams
from tests.engine.conftest import running_engine
from tests.engine.test_engine import make_prompts

MODEL = "llama-gqa"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async_scheduling"])
async def test_every_block_is_free_when_the_last_request_returns(
    mode: str, kind: RequestOutputKind, ahead: bool, tiny_checkpoint: Callable[[str], Path]
) -> None:
    path = tiny_checkpoint(MODEL)
    prompts = make_prompts(12, seed=4)

    def greedy(stop: list[str] | None = None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=kind,
                              stop=stop)  # fmt: skip

    with anyio.fail_after(120):
        async with running_engine(path, num_device_blocks=10, preemption_mode=mode,
                                  async_scheduling=ahead) as engine:  # fmt: skip
            # A stop string the first prompt's greedy text is known to contain.
            text = (await engine.generate(list(prompts[0]), greedy())).outputs[0].text
            await engine.wait_idle()
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            assert stop.strip(), f"no usable stop string in {text!r}"
            outputs: list[RequestOutput | None] = [None] * len(prompts)

            async def one(i: int) -> None:
                stream = engine.generate(list(prompts[i]), greedy([stop] if i % 3 == 0 else None))
                if kind is RequestOutputKind.DELTA:
                    async for out in stream:
                        outputs[i] = out
                else:
                    outputs[i] = await stream

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            stats = engine.statistics()  # at once: the last reader has just returned
    assert all(o is not None and o.finished for o in outputs)
    assert stats.num_free_device_blocks == stats.num_device_blocks, stats
    assert stats.num_free_host_blocks == stats.num_host_blocks, stats
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0), stats
    assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    stopped = [o for o in outputs if o is not None and o.outputs[0].stop_reason == stop]
    assert stopped, "no request ended on the stop string"
