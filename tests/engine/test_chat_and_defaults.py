"""Chat through the chat template, generation_config.json (EOS lists, sampling defaults) and the
prompt forms, end to end on a tiny checkpoint against transformers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import InvalidRequestError, SamplingParams
from asyncpaged.testing.tiny_models import EOS_ID
from tests.engine.conftest import running_engine
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _copy(src: Path, dst: Path, generation: dict[str, Any] | None = None) -> Path:
    shutil.copytree(src, dst)
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


@pytest.fixture(scope="module")
def chat_model(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama with a chat template (saved as transformers saves one)."""
    from transformers import AutoTokenizer

    path = _copy(tiny_checkpoint("llama-gqa"), tmp_path_factory.mktemp("chat") / "model")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


def _template_ids(path: Path, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


async def test_chat_prompt_is_the_chat_template_and_output_matches_transformers(
    chat_model: Path,
) -> None:
    messages = [
        {"role": "system", "content": "the paged attention design"},
        {"role": "user", "content": "blocks of memory"},
    ]
    want_ids = _template_ids(chat_model, messages, add_generation_prompt=True)
    reference = HFReference(chat_model)
    async with running_engine(chat_model) as engine:
        out = await engine.chat(messages, GREEDY)
        assert out.prompt_token_ids == want_ids
        assert out.prompt is not None
        assert out.prompt.endswith("<s>assistant:")
        assert out.outputs[0].token_ids == reference.generate(tuple(want_ids), 6)[0]
        # continue_final_message: the last assistant message stays open.
        partial = [*messages, {"role": "assistant", "content": "the"}]
        cont = await engine.chat(
            partial, GREEDY, add_generation_prompt=False, continue_final_message=True
        )
        assert cont.prompt_token_ids == _template_ids(
            chat_model, partial, add_generation_prompt=False, continue_final_message=True
        )
        # A template given per call, with extra variables.
        custom = "{{ greeting }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
        own = await engine.chat(
            messages, GREEDY, chat_template=custom, chat_template_kwargs={"greeting": "The"}
        )
        assert own.prompt == "The the paged attention design blocks of memory"
        # Tools reach the template as transformers passes them.
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
        with_tools = (
            "{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
            "{{ messages[-1]['content'] }}"
        )
        used = await engine.chat(messages, GREEDY, chat_template=with_tools, tools=tools)
        assert used.prompt == "lookup blocks of memory"


async def test_chat_errors_are_the_requests_own(
    chat_model: Path, tiny_checkpoint: Callable[[str], Path]
) -> None:
    async with running_engine(chat_model) as engine:
        for bad in ("hi", [], [{"content": "no role"}], [{"role": "user", "content": 3}]):
            with pytest.raises(InvalidRequestError):
                engine.chat(bad, GREEDY)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="add_generation_prompt=False"):
            engine.chat([{"role": "user", "content": "x"}], GREEDY, continue_final_message=True)
        broken = "{{ messages[0]['content'] | no_such_filter }}"
        innocent = engine.generate([5, 6, 7], GREEDY)
        with pytest.raises(InvalidRequestError, match="chat template failed"):
            await engine.chat([{"role": "user", "content": "x"}], GREEDY, chat_template=broken)
        assert len((await innocent).outputs[0].token_ids) == 6
    async with running_engine(tiny_checkpoint("llama-gqa")) as engine:  # no template at all
        with pytest.raises(InvalidRequestError, match="chat template failed"):
            await engine.chat([{"role": "user", "content": "x"}], GREEDY)


async def test_multi_turn_chat_hits_the_prefix_cache(chat_model: Path) -> None:
    """Each turn's prompt starts with the previous turn's prompt: its full blocks are cached."""
    questions = ["the paged attention", "blocks of memory", "copy on write", "swap", "recompute"]
    messages: list[dict[str, str]] = [{"role": "system", "content": "the scheduler batches"}]
    hits: list[int] = []
    expected: list[int] = []
    async with running_engine(chat_model) as engine:
        previous: list[int] = []
        for question in questions:
            messages.append({"role": "user", "content": question})
            before = engine.statistics().prefix_cache_hit_tokens
            out = await engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=8))
            hits.append(engine.statistics().prefix_cache_hit_tokens - before)
            ids = out.prompt_token_ids
            common = next(
                (i for i, (a, b) in enumerate(zip(previous, ids, strict=False)) if a != b),
                min(len(previous), len(ids)),
            )
            # Full blocks of the shared prefix, less the last prompt token (always recomputed).
            expected.append(min(common, len(ids) - 1) // 16 * 16)
            previous = ids + list(out.outputs[0].token_ids)
            messages.append({"role": "assistant", "content": out.outputs[0].text})
    assert hits[0] == 0
    assert hits[1:] == expected[1:]
    assert sum(hits) >= 3 * 16, hits


@pytest.fixture(scope="module")
def two_eos_model(
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, tuple[int, ...], list[int]]:
    """(checkpoint whose generation_config.json lists two EOS ids, a prompt, its greedy
    tokens): the second id is the fourth token greedy decoding produces, never produced
    earlier."""
    prompt = tuple(range(40, 57))
    tokens = hf_reference("llama-gqa").generate(prompt, 12)[0]
    index = next(i for i in range(3, 12) if tokens[i] not in tokens[:i] and tokens[i] != EOS_ID)
    assert EOS_ID not in tokens[: index + 1]
    generation = {"bos_token_id": 1, "eos_token_id": [EOS_ID, tokens[index]], "pad_token_id": 0}
    path = _copy(tiny_checkpoint("llama-gqa"), tmp_path_factory.mktemp("eos") / "m", generation)
    return path, prompt, tokens[: index + 1]


async def test_second_end_of_turn_id_stops_like_transformers(
    two_eos_model: tuple[Path, tuple[int, ...], list[int]],
) -> None:
    path, prompt, want = two_eos_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=12, pad_token_id=0)  # fmt: skip
    assert hf[0, len(prompt) :].tolist() == want  # transformers stops at the second id
    async with running_engine(path) as engine:
        assert engine.generation_defaults.eos_token_ids == {EOS_ID, want[-1]}
        params = SamplingParams(temperature=0.0, max_tokens=12)
        out = (await engine.generate(list(prompt), params)).outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (want, "stop", None)
        ignored = (await engine.generate(list(prompt), SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True))).outputs[0]  # fmt: skip
        assert (len(ignored.token_ids), ignored.finish_reason) == (12, "length")
        # min_tokens masks every EOS id until it is reached.
        late = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=len(want) + 1)
        masked = (await engine.generate(list(prompt), late)).outputs[0]
        assert want[-1] not in masked.token_ids[: len(want) + 1]
    async with running_engine(path, generation_config="none") as engine:
        out = (await engine.generate(list(prompt), params)).outputs[0]
        assert out.finish_reason == "length"


async def test_generation_config_sampling_defaults(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    generation = {"eos_token_id": EOS_ID, "do_sample": True, "temperature": 0.6, "top_k": 20,
                  "top_p": 0.95, "repetition_penalty": 1.1, "max_new_tokens": 9}  # fmt: skip
    path = _copy(tiny_checkpoint("llama-gqa"), tmp_path / "m", generation)
    async with running_engine(path) as engine:
        defaults = engine.default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.6, 20, 0.95)
        assert (defaults.repetition_penalty, defaults.max_tokens) == (1.1, 9)
        out = await engine.generate([5, 6, 7], SamplingParams(seed=1, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 9  # max_tokens from max_new_tokens
        # Fields the caller sets win, the rest come from the model; seeded runs agree.
        mine = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.1,
                              max_tokens=9, seed=1, ignore_eos=True)  # fmt: skip
        again = await engine.generate([5, 6, 7], mine)
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
        greedy = await engine.generate([5, 6, 7], SamplingParams(temperature=0.0))
        assert len(greedy.outputs[0].token_ids) == 9
        explicit = await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3))
        assert len(explicit.outputs[0].token_ids) == 3
    async with running_engine(path, generation_config="none") as engine:
        assert engine.default_sampling_params() == SamplingParams()
        out = await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 16


async def test_prompt_forms(tiny_checkpoint: Callable[[str], Path]) -> None:
    path = tiny_checkpoint("llama-gqa")
    async with running_engine(path) as engine:
        ids = engine.tokenizer.encode("the paged attention")
        results = [
            await engine.generate(form, GREEDY)
            for form in (
                "the paged attention",
                ids,
                {"prompt": "the paged attention"},
                {"prompt_token_ids": ids},
                {"prompt_token_ids": ids, "cache_salt": "tenant-a"},
                tuple(torch.tensor(ids)),  # torch integer scalars
            )
        ]
        assert all(r.prompt_token_ids == ids for r in results)
        assert len({tuple(r.outputs[0].token_ids) for r in results}) == 1
        bad_prompts = [None, 3, 2.5, b"abc", {"text": "x"}, {"prompt": 3}, [True, 5], [[1, 2]],
                       {"prompt": "x", "cache_salt": 7}, {"prompt_token_ids": "ab"}]  # fmt: skip
        for bad in bad_prompts:
            with pytest.raises(InvalidRequestError, match=r"prompt|cache_salt|token ids"):
                engine.generate(bad, GREEDY)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="twice"):
            engine.generate({"prompt": "x", "cache_salt": "a"}, GREEDY, cache_salt="b")
        with anyio.fail_after(30):
            await engine.wait_idle()
