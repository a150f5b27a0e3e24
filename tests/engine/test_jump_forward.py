"""Jump-forward decoding of structured outputs on the tiny Llama: the tokens a grammar forces are
appended without sampling (fewer steps, ``num_jump_forward_tokens``), the JSON still validates,
greedy outputs are the same with and without preemption (swap, recompute), parallel sampling
keeps one matcher per sequence, and max_tokens, stop strings, logprobs and abort hold."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest

from asyncpaged import SamplingParams, StructuredOutputsParams
from tests.engine.conftest import running_engine
from tests.engine.test_engine import make_prompts
from tests.engine.test_structured_outputs import SCHEMA, _all

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"
COMPACT = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


async def _run(
    model: Path, prompts: list[list[int]], params: SamplingParams, **config: Any
) -> tuple[list[Any], Any]:
    with anyio.fail_after(120):
        async with running_engine(model, **config) as engine:
            outs = await _all(engine, prompts, params)
            return outs, engine.statistics()


async def test_forced_tokens_skip_sampling_steps(tiny_checkpoint: Callable[[str], Path]) -> None:
    prompts = [list(p) for p in make_prompts(6, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=COMPACT)
    model = tiny_checkpoint(MODEL)
    off, off_stats = await _run(model, prompts, params, structured_outputs_jump_forward=False)
    on, on_stats = await _run(model, prompts, params)  # on by default
    for out in (*off, *on):
        assert out.outputs[0].finish_reason == "stop"
        _valid(out.outputs[0].text)
    assert off_stats.num_jump_forward_tokens == 0
    # the keys and punctuation of every object were forced: most tokens, few steps
    num_tokens = sum(len(o.outputs[0].token_ids) for o in on)
    assert on_stats.num_jump_forward_tokens > num_tokens // 2
    assert on_stats.num_steps * 2 < off_stats.num_steps


async def test_greedy_jump_forward_is_the_same_under_swap_and_recompute(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Matchers and forced tokens survive preemption: the same tokens without memory pressure,
    by swap and by recompute; n = 2 seeded sampling keeps a matcher per sequence."""
    prompts = [list(p) for p in make_prompts(8, seed=4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=COMPACT)
    sampled = SamplingParams(temperature=1.0, n=2, seed=11, max_tokens=64,
                             structured_outputs=COMPACT)  # fmt: skip
    results = []
    for config in ({}, {"num_device_blocks": 8, "preemption_mode": "swap"},
                   {"num_device_blocks": 8, "preemption_mode": "recompute"}):  # fmt: skip
        outs, stats = await _run(tiny_checkpoint(MODEL), prompts, greedy, **config)
        wider = {**config, "num_device_blocks": 12} if config else {}  # two sequences a request
        more, more_stats = await _run(tiny_checkpoint(MODEL), prompts[:3], sampled, **wider)
        if config:
            assert stats.num_preemptions > 0
            assert more_stats.num_preemptions > 0
        assert stats.num_jump_forward_tokens > 0 and more_stats.num_jump_forward_tokens > 0
        rows = [c for o in (*outs, *more) for c in o.outputs]
        assert len(rows) == 8 + 3 * 2
        for c in rows:
            assert c.finish_reason == "stop"
            _valid(c.text)
        results.append([(c.text, tuple(c.token_ids)) for c in rows])
    assert results[0] == results[1] == results[2]


async def test_forced_tokens_count_toward_max_tokens_and_stop_strings(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    prompts = [list(p) for p in make_prompts(3, seed=5)]
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        for max_tokens in (1, 2, 3, 5):  # the first key alone is forced as several tokens
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                    structured_outputs=COMPACT)  # fmt: skip
            for out in await _all(engine, prompts, params):
                c = out.outputs[0]
                assert (len(c.token_ids), c.finish_reason) == (max_tokens, "length")
        assert engine.statistics().num_jump_forward_tokens > 0
        # a stop string inside forced text ends the output before it, as when sampled
        params = SamplingParams(temperature=0.0, max_tokens=64, stop=['"age'],
                                structured_outputs=COMPACT)  # fmt: skip
        for out in await _all(engine, prompts, params):
            c = out.outputs[0]
            assert (c.finish_reason, c.stop_reason) == ("stop", '"age')
            assert c.text.startswith('{"name": "') and c.text.endswith('", ')
            assert engine.tokenizer.decode(c.token_ids).startswith(c.text)


async def test_logprob_requests_do_not_jump_and_abort_frees(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """A forced token's logprob is never computed, so requests that report logprobs sample
    every token; aborting a request with forced tokens pending frees its blocks."""
    prompts = [list(p) for p in make_prompts(3, seed=6)]
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=96, logprobs=1,
                                structured_outputs=COMPACT)  # fmt: skip
        for out in await _all(engine, prompts, params):
            c = out.outputs[0]
            _valid(c.text)
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert engine.statistics().num_jump_forward_tokens == 0
        params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=COMPACT)
        with anyio.fail_after(60):
            stream = engine.generate(prompts[0], params, request_id="jf-abort")
            async for out in stream:
                if len(out.outputs[0].token_ids) > 1:  # forced tokens arrived
                    break
            await engine.abort("jf-abort")
            await engine.wait_idle()
        assert engine.statistics().num_jump_forward_tokens > 0
