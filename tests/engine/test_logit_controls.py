"""vLLM's logit controls end to end: ``logit_bias``, ``allowed_token_ids`` and ``bad_words``
(its multi-token rule), checked against transformers' logits and by construction."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncpaged import (
    InvalidRequestError,
    RequestFailedError,
    SamplingParams,
    StructuredOutputsParams,
)
from asyncpaged.actors.scheduler import bad_words_token_ids, banned_next_tokens
from asyncpaged.errors import NoTokenAllowedError
from asyncpaged.testing.tiny_models import VOCAB_SIZE
from tests.engine.conftest import running_engine
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"
PROMPT = list(range(40, 57))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_logit_bias_matches_biased_transformers_logits(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    ref = hf_reference(MODEL)
    plain = ref.generate(tuple(PROMPT), 8)[0]
    # Push the greedy tokens down and two others up: a different, fully determined path.
    bias = {plain[0]: -8.0, plain[1]: -5.0, 7: 3.0, 11: 2.5}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=bias)
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        out = (await engine.generate(PROMPT, params)).outputs[0].token_ids
        forced = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                logit_bias={9: 100.0})  # fmt: skip
        assert (await engine.generate(PROMPT, forced)).outputs[0].token_ids == [9] * 4
    assert out != plain
    scores = ref.score(tuple(PROMPT), tuple(out))  # [8, V] log-softmax, teacher-forced
    biased = scores.clone()
    for token, b in bias.items():
        biased[:, token] += b
    assert out == biased.argmax(dim=-1).tolist()


async def test_allowed_token_ids_bound_every_sample(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    allowed = [5, 17, 42, 99, 250]
    async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=12) as engine:
        sampled = SamplingParams(n=4, temperature=1.2, seed=3, max_tokens=12, ignore_eos=True,
                                 allowed_token_ids=allowed)  # fmt: skip
        out = await engine.generate(PROMPT, sampled)
        assert len(out.outputs) == 4
        for completion in out.outputs:
            assert set(completion.token_ids) <= set(allowed)
        assert len({t for c in out.outputs for t in c.token_ids}) > 1  # it did sample
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                allowed_token_ids=allowed)  # fmt: skip
        tokens = (await engine.generate(PROMPT, greedy)).outputs[0].token_ids
    scores = hf_reference(MODEL).score(tuple(PROMPT), tuple(tokens))
    mask = torch.full((VOCAB_SIZE,), float("-inf"))
    mask[allowed] = 0.0
    assert tokens == (scores + mask).argmax(dim=-1).tolist()


def test_bad_word_rule_is_vllms() -> None:
    words = ((7,), (3, 4, 5), (9, 9))
    assert banned_next_tokens(words, []) == (7,)
    assert banned_next_tokens(words, [1, 3, 4]) == (7, 5)  # the rest of (3, 4, 5) ends it
    assert banned_next_tokens(words, [3, 4, 1]) == (7,)
    assert banned_next_tokens(words, [9]) == (7, 9)
    assert banned_next_tokens((), [1, 2]) == ()


async def test_bad_words_are_never_generated(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """A one-token and a two-token word taken from the greedy output, banned: the output
    avoids the first everywhere and the second's last token after its first."""
    plain = hf_reference(MODEL).generate(tuple(PROMPT), 10)[0]
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        tok = engine.tokenizer

        def word_of(ids: list[int]) -> str | None:  # text that tokenizes back into ids
            text = tok.decode(ids)
            same = tok.encode(text.lstrip(), add_special_tokens=False) == ids
            return text if same and text.strip() else None

        one = next(w for t in plain if (w := word_of([t])))
        two = next(w for a, b in itertools.pairwise(plain) if (w := word_of([a, b])))
        ids = bad_words_token_ids(tok, (one, two))
        single = next(w for w in ids if len(w) == 1)
        pair = next(w for w in ids if len(w) == 2)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                bad_words=[one, two])  # fmt: skip
        out = (await engine.generate(PROMPT, params)).outputs[0].token_ids
    assert out != plain
    assert single[0] not in out
    assert all(tuple(out[i : i + 2]) != pair for i in range(len(out) - 1))


async def test_bad_ids_are_refused_before_queueing(tiny_checkpoint: Callable[[str], Path]) -> None:
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        for params in (
            SamplingParams(logit_bias={VOCAB_SIZE: 1.0}),
            SamplingParams(allowed_token_ids=[1, VOCAB_SIZE + 5]),
        ):
            with pytest.raises(InvalidRequestError, match="token ids must be in"):
                engine.generate(PROMPT, params)
        assert engine.statistics().num_waiting == 0


async def test_detokenize_truncate_and_decoded_tokens(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """vLLM's ``detokenize=False`` (ids only), ``truncate_prompt_tokens`` (the prompt's last k
    tokens) and ``Logprob.decoded_token`` (each id's text)."""
    ref = hf_reference(MODEL)
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        greedy = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
        plain = await engine.generate(PROMPT, SamplingParams(detokenize=False, **greedy))
        assert plain.outputs[0].text == ""
        assert plain.outputs[0].token_ids == ref.generate(tuple(PROMPT), 5)[0]
        cut = SamplingParams(truncate_prompt_tokens=6, **greedy)
        for prompt in (PROMPT, engine.tokenizer.decode(PROMPT)):
            out = await engine.generate(prompt, cut)
            assert len(out.prompt_token_ids) == 6
            want = ref.generate(tuple(out.prompt_token_ids), 5)[0]
            assert out.outputs[0].token_ids == want
        scored = await engine.generate(PROMPT, SamplingParams(logprobs=2, **greedy))
        completion = scored.outputs[0]
        assert completion.logprobs is not None
        for position in completion.logprobs:
            assert len(position) >= 2
            for token_id, logprob in position.items():
                assert logprob.decoded_token == engine.tokenizer.decode([token_id])
        silent = await engine.generate(
            PROMPT, SamplingParams(logprobs=1, detokenize=False, **greedy)
        )
        assert silent.outputs[0].logprobs is not None
        assert all(
            lp.decoded_token is None for p in silent.outputs[0].logprobs for lp in p.values()
        )
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


async def test_logits_processors_run_per_request_and_fail_alone(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """A processor sees the request's output so far and its row's logits; one that raises
    fails its own request with RequestFailedError while the others finish exactly."""
    seen: list[list[int]] = []

    def force_seven_then_eight(output: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(output))
        out = torch.full_like(logits, float("-inf"))
        out[7 if len(output) % 2 == 0 else 8] = 0.0
        return out

    def broken(output: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output) >= 2:
            raise RuntimeError("boom")
        return logits

    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    async with running_engine(tiny_checkpoint(MODEL)) as engine:
        innocent = engine.generate(PROMPT, SamplingParams(**greedy))
        forced = engine.generate(
            PROMPT, SamplingParams(logits_processors=[force_seven_then_eight], **greedy)
        )
        failing = engine.generate(PROMPT, SamplingParams(logits_processors=[broken], **greedy))
        with pytest.raises(RequestFailedError) as info:
            await failing
        assert isinstance(info.value.__cause__, RuntimeError)
        assert (await forced).outputs[0].token_ids == [7, 8, 7, 8, 7, 8]
        assert (await innocent).outputs[0].token_ids == hf_reference(MODEL).generate(
            tuple(PROMPT), 6
        )[0]
    assert seen[:3] == [[], [7], [7, 8]]
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=[3])  # type: ignore[list-item]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_constraints_that_allow_no_token_fail_their_request_alone(
    kind: str, tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    """A grammar whose every token ``allowed_token_ids`` excludes, or allowed ids all banned
    as bad words, greedy and seeded: the request fails with RequestFailedError (its cause
    NoTokenAllowedError), before any token it ruled out is drawn; the others finish exactly.
    The same with the runner in its own process and steps planned ahead."""
    config = {"executor_backend": "process", "async_scheduling": True} if kind == "async" else {}
    choice = StructuredOutputsParams(choice=["paged", "blocks"])
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    async with running_engine(tiny_checkpoint(MODEL), **config) as engine:
        tokenizer = engine.tokenizer
        word = tokenizer.decode([300]).strip()
        innocent = engine.generate(PROMPT, SamplingParams(**greedy))
        doomed = [
            engine.generate(PROMPT, SamplingParams(structured_outputs=choice,
                                                   allowed_token_ids=[5, 6], **greedy)),
            engine.generate(PROMPT, SamplingParams(temperature=0.8, seed=1, max_tokens=6,
                                                   allowed_token_ids=[300], bad_words=[word])),
        ]  # fmt: skip
        for stream in doomed:
            with pytest.raises(RequestFailedError, match="allowed no token") as info:
                await stream
            assert isinstance(info.value.__cause__, NoTokenAllowedError)
        want = hf_reference(MODEL).generate(tuple(PROMPT), 6)[0]
        assert (await innocent).outputs[0].token_ids == want
