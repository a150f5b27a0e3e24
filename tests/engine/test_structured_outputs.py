"""Structured outputs end to end on the tiny Llama: choices, regexes, JSON schemas and JSON
objects hold for every request that stops, greedy and sampled, n > 1, under preemption; bad
constraints fail their own request."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import anyio
import jsonschema
import pytest

from asyncpaged import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tests.engine.conftest import running_engine
from tests.engine.test_engine import make_prompts

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"
SCHEMA = {
    "type": "object",
    "properties": {
        # An enum, not a maxLength string: xgrammar 0.2.9 lets a length-bounded string hold
        # raw control characters (invalid JSON); an unbounded one a random model never closes.
        "name": {"enum": ["ann", "bob", "carl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _params(constraint: StructuredOutputsParams, **kw: object) -> SamplingParams:
    base: dict[str, object] = {"temperature": 0.0, "max_tokens": 96}
    base.update(kw)
    return SamplingParams(structured_outputs=constraint, **base)  # type: ignore[arg-type]


async def _all(engine: object, prompts: list[list[int]], params: SamplingParams) -> list[object]:
    results: list[object] = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await engine.generate(prompts[i], params)  # type: ignore[attr-defined]

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-n3"])
async def test_choice_regex_and_json_hold(
    sampled: bool, tiny_checkpoint: Callable[[str], Path]
) -> None:
    extra: dict[str, object] = {"temperature": 1.0, "n": 3, "seed": 5} if sampled else {}
    prompts = [list(p) for p in make_prompts(6, seed=8)]
    choices = ["paged", "blocks", "copy on write"]
    regex = r"[a-z]{3}-[0-9]{2}"
    stopped: dict[str, int] = {}
    with anyio.fail_after(120):
        async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=24) as engine:
            cases = [
                (StructuredOutputsParams(choice=choices), lambda t: t in choices),
                (StructuredOutputsParams(regex=regex), lambda t: re.fullmatch(regex, t)),
                (StructuredOutputsParams(json=SCHEMA), _valid_json),
                (StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
                 _valid_json),
                (StructuredOutputsParams(json_object=True),
                 lambda t: isinstance(json.loads(t), dict)),
            ]  # fmt: skip
            for constraint, holds in cases:
                outs = await _all(engine, prompts, _params(constraint, **extra))
                for out in outs:
                    for completion in out.outputs:  # type: ignore[attr-defined]
                        if completion.finish_reason == "stop":
                            key = f"{constraint.kind}{constraint.disable_any_whitespace:d}"
                            stopped[key] = stopped.get(key, 0) + 1
                            assert holds(completion.text), (constraint.kind, completion.text)
    # Bounded grammars (a choice, a fixed-length regex, a compact schema of enums and bounded
    # numbers) end every request; with free whitespace a random model may pad to max_tokens.
    total = len(prompts) * (3 if sampled else 1)
    assert (stopped["choice0"], stopped["regex0"], stopped["json1"]) == (total,) * 3, stopped


def _valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


async def test_json_under_preemption_by_swap_and_recompute(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """Matchers follow tokens, not blocks: preempted requests still produce valid JSON, and the
    same JSON as without memory pressure."""
    prompts = [list(p) for p in make_prompts(10, seed=9)]
    params = _params(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                     max_tokens=64)  # fmt: skip
    texts = []
    for config in ({}, {"num_device_blocks": 8, "preemption_mode": "swap"},
                   {"num_device_blocks": 8, "preemption_mode": "recompute"}):  # fmt: skip
        with anyio.fail_after(120):
            async with running_engine(tiny_checkpoint(MODEL), **config) as engine:
                outs = await _all(engine, prompts, params)
                if config:
                    assert engine.statistics().num_preemptions > 0
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)  # type: ignore[attr-defined]
        texts.append([o.outputs[0].text for o in outs])  # type: ignore[attr-defined]
    assert texts[0] == texts[1] == texts[2]
    for text in texts[0]:
        _valid_json(text)


async def test_bad_constraints_fail_their_own_request(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        innocent = engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
        for bad in (StructuredOutputsParams(regex="[0-9"),
                    StructuredOutputsParams(json={"type": "nonsense"}),
                    StructuredOutputsParams(grammar="root ::= undefined_rule")):  # fmt: skip
            with pytest.raises(InvalidRequestError, match="invalid structured output"):
                await engine.generate([5, 6, 7], _params(bad))
        assert len((await innocent).outputs[0].token_ids) == 4


ENGINES = {
    "sync": {"executor_backend": "thread", "async_scheduling": False},
    "async": {"executor_backend": "process", "async_scheduling": True},
}


@pytest.mark.parametrize("engine_kind", list(ENGINES))
async def test_a_grammar_ended_by_its_stop_token_constrains_nothing_more(
    engine_kind: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """``ignore_eos`` past a grammar's end (the stop token accepted, the output going on):
    the rest is unconstrained, as in vLLM, for greedy and seeded requests beside constrained
    ones; the engine lives on (asking an ended matcher for a bitmask killed it)."""
    choices = ["paged", "blocks"]
    prompts = [list(p) for p in make_prompts(6, seed=11)]
    constraint = StructuredOutputsParams(choice=choices)
    async with running_engine(tiny_checkpoint(MODEL), **ENGINES[engine_kind]) as engine:
        with anyio.fail_after(120):
            past = await _all(engine, prompts, _params(constraint, max_tokens=12, ignore_eos=True))
            seeded = await _all(engine, prompts, _params(
                constraint, max_tokens=12, ignore_eos=True, temperature=1.0, seed=3))  # fmt: skip
            ends = await _all(engine, prompts, _params(constraint, max_tokens=12))
    eos = 2  # the built-in tokenizer's </s>
    for out in [*past, *seeded]:
        completion = out.outputs[0]  # type: ignore[attr-defined]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 12
        assert eos in completion.token_ids  # the grammar ended, the output went on
        assert any(completion.text.startswith(c) for c in choices), completion.text
    for out in ends:
        completion = out.outputs[0]  # type: ignore[attr-defined]
        assert completion.finish_reason == "stop" and completion.text in choices


@pytest.mark.parametrize("engine_kind", list(ENGINES))
async def test_min_tokens_yields_where_the_grammar_may_only_end(
    engine_kind: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """``min_tokens`` past what a grammar allows: where the grammar may only end, the stop
    token goes through and ends the output (vLLM's rule), instead of a token the grammar
    rules out; a grammar that may go on keeps ``min_tokens``."""
    prompts = [list(p) for p in make_prompts(6, seed=12)]
    choice = StructuredOutputsParams(choice=["paged", "blocks"])
    digits = StructuredOutputsParams(regex=r"[0-9]+")
    async with running_engine(tiny_checkpoint(MODEL), **ENGINES[engine_kind]) as engine:
        with anyio.fail_after(120):
            short = await _all(engine, prompts, _params(choice, max_tokens=30, min_tokens=20))
            long = await _all(engine, prompts, _params(digits, max_tokens=12, min_tokens=8))
    for out in short:  # ended by EOS, before min_tokens, with no token between
        completion = out.outputs[0]  # type: ignore[attr-defined]
        assert completion.finish_reason == "stop", completion
        assert completion.text in ("paged", "blocks"), completion
        assert completion.token_ids[-1] == 2 and len(completion.token_ids) < 20, completion
        assert engine.tokenizer.decode(completion.token_ids[:-1]) == completion.text
    for out in long:
        completion = out.outputs[0]  # type: ignore[attr-defined]
        assert len(completion.token_ids) >= 8, completion
        assert re.fullmatch(r"[0-9]+", completion.text), completion
