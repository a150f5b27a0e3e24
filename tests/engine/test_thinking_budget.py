"""``SamplingParams.thinking_token_budget`` end to end on a tiny Llama whose tokenizer has
``<think>``/``</think>`` as added tokens and whose chat template opens ``<think>\\n`` in the
generation prompt (DeepSeek-R1's way): with budget N the output is the first N tokens the model
writes unbudgeted, the end marker, then what greedy decoding writes after that forced prefix;
budget 0 forces the marker first; a reply that closes its thinking first is untouched; n = 2
and preemption by recompute; the refusals."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpaged import AsyncEngine, EngineConfig, SamplingParams
from asyncpaged.errors import InvalidRequestError
from asyncpaged.reasoning import DeepSeekR1ReasoningParser
from asyncpaged.testing.tiny_models import VOCAB_SIZE, build_tiny_model, build_tokenizer
from tests.engine.conftest import running_engine

pytestmark = pytest.mark.anyio
START, END = VOCAB_SIZE, VOCAB_SIZE + 1  # the added tokens' ids
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' and m.get('reasoning') %}"
    "<think>{{ m['reasoning'] }}</think>{% endif %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: <think>\\n' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "the sky is blue and the"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with two more ids: its tokenizer's added <think> and </think>."""
    path = tmp_path_factory.mktemp("thinking-llama")
    model = build_tiny_model("llama-gqa")
    model.resize_token_embeddings(VOCAB_SIZE + 2)
    model.save_pretrained(str(path))
    tok = build_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [START, END]
    return path


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def _ids(engine: AsyncEngine, prompt: Sequence[int], params: SamplingParams) -> list[int]:
    out = await engine.generate(list(prompt), params)
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_budget_forces_the_end_marker(thinking_model: Path, async_scheduling: bool) -> None:
    m = 20
    with anyio.fail_after(60):
        async with running_engine(thinking_model, async_scheduling=async_scheduling) as engine:
            assert engine.reasoning_parser is DeepSeekR1ReasoningParser  # "auto": the template
            base = await engine.chat(CHAT, _greedy(m))
            prompt = list(base.prompt_token_ids or ())
            assert base.prompt is not None and base.prompt.endswith("assistant: <think>\n")
            free = list(base.outputs[0].token_ids)
            assert END not in free  # this model never closes its thinking by itself
            for n in (0, 1, 5):
                stream = engine.chat(CHAT, _greedy(m, thinking_token_budget=n))
                state = stream._state
                before = state.in_reasoning_at_start  # not known before the intake
                out = await stream
                assert (before, state.in_reasoning_at_start) == (False, True)
                got = list(out.outputs[0].token_ids)
                assert got[:n] == free[:n]
                assert got[n] == END
                after = await _ids(engine, prompt + free[:n] + [END], _greedy(m - n - 1))
                assert got[n + 1 :] == after
                assert len(got) == m and out.outputs[0].finish_reason == "length"
                # the reply split at the forced marker: thinking before it, the answer after
                completion = out.outputs[0]
                raw = engine.tokenizer.decode(got)
                assert (completion.reasoning is None) == (n == 0)  # None: no thinking at all
                assert "</think>" not in completion.text
                assert (completion.reasoning or "") + "</think>" + completion.text == raw
            # the same through a prompt of ids (decoded to tell it opens the thinking)
            assert await _ids(engine, prompt, _greedy(m, thinking_token_budget=5)) == got
            # a prompt that does not open the thinking: deepseek_r1 reads every reply as
            # starting inside it, and so does the budget
            plain = prompt[: -len(engine.tokenizer.encode("<think>\n"))]
            unopened = await _ids(engine, plain, _greedy(8, thinking_token_budget=2))
            assert unopened[:3] == [*(await _ids(engine, plain, _greedy(2))), END]


async def test_a_reply_that_closes_its_thinking_is_untouched(thinking_model: Path) -> None:
    """Seeded sampling among a few ids, </think> one of them: the reply closes its thinking
    at some position p; a budget past p changes nothing, one before p forces the marker."""
    pick = [END, 40, 41, 42]
    params: dict[str, Any] = {"temperature": 1.0, "seed": 7, "max_tokens": 16,
                              "allowed_token_ids": pick}  # fmt: skip
    with anyio.fail_after(60):
        async with running_engine(thinking_model) as engine:
            base = await engine.chat(CHAT, SamplingParams(**params))
            prompt, free = list(base.prompt_token_ids or ()), list(base.outputs[0].token_ids)
            p = free.index(END)
            for budget in (p, p + 1, p + 5):
                got = await _ids(
                    engine, prompt, SamplingParams(**params, thinking_token_budget=budget)
                )
                assert got == free
            if p >= 2:
                got = await _ids(engine, prompt, SamplingParams(**params, thinking_token_budget=1))
                assert got[:2] == [free[0], END]


async def test_n2_and_recompute_preemption(thinking_model: Path) -> None:
    """Each of n = 2 seeded completions is cut at its own N-th token; requests preempted by
    recompute (a tiny KV cache) give the same tokens as without preemption."""
    sampled = SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=12)
    budgeted = SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=12, thinking_token_budget=4)
    with anyio.fail_after(60):
        async with running_engine(thinking_model) as engine:
            base = await engine.chat(CHAT, sampled)
            out = await engine.chat(CHAT, budgeted)
            prompt = list(base.prompt_token_ids or ())
            for b, o in zip(base.outputs, out.outputs, strict=True):
                assert list(o.token_ids[:4]) == list(b.token_ids[:4])
                assert o.token_ids[4] == END and END not in b.token_ids
            zero = await engine.chat(
                CHAT,
                SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=6, thinking_token_budget=0),
            )
            # (parallel sampling forks at its first sampled token: budget 0 ends after it)
            assert [c.token_ids[1] for c in zero.outputs] == [END, END]
            prompts = [prompt[:k] + prompt[-4:] for k in range(4, 10)]
            greedy = _greedy(24, thinking_token_budget=6)
            calm = [await _ids(engine, p, greedy) for p in prompts]
        small: dict[str, Any] = {"num_device_blocks": 12, "block_size": 4,
                                 "preemption_mode": "recompute"}  # fmt: skip
        async with running_engine(thinking_model, **small) as engine:
            results: list[list[int]] = [[] for _ in prompts]

            async def one(i: int) -> None:
                results[i] = await _ids(engine, prompts[i], greedy)

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            assert engine.statistics().num_preemptions > 0
            assert results == calm
            assert all(r[6] == END for r in results)


async def test_refusals(thinking_model: Path) -> None:
    with pytest.raises(InvalidRequestError, match="unknown reasoning parser 'nope'; known:"):
        AsyncEngine(EngineConfig(model=str(thinking_model), reasoning_parser="nope"))
    with anyio.fail_after(60):
        async with running_engine(thinking_model, reasoning_parser=None) as engine:
            assert engine.reasoning_parser is None
            with pytest.raises(InvalidRequestError, match="needs a reasoning parser"):
                engine.generate([5, 6, 7], _greedy(4, thinking_token_budget=3))
            out = await engine.chat(CHAT, _greedy(4))
            assert out.outputs[0].finish_reason == "length"
