"""``SamplingParams(prompt_logprobs=k)`` end to end, against transformers' log-softmax of one
forward over the prompt: chunked prefill, block boundaries, the prefix cache, preemption by
recompute (with and without async scheduling), output kinds, and the native and torch
attention backends."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpaged import InvalidRequestError, RequestOutputKind, SamplingParams
from asyncpaged.actors import step_builder
from asyncpaged.kv.block_pool import BlockPool
from asyncpaged.outputs import Logprob, PromptLogprobs, RequestOutput
from asyncpaged.streams import RequestState
from asyncpaged.testing.tiny_models import VOCAB_SIZE
from asyncpaged.worker import prompt_logprobs as plp_module
from asyncpaged.worker.protocol import PromptLogprobRows
from tests.engine.conftest import running_engine
from tests.model.reference import HFReference

pytestmark = pytest.mark.anyio
MODEL = "llama-gqa"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 320) for _ in range(length)]


def plp_params(k: int, **kwargs: Any) -> SamplingParams:
    """Greedy, 6 tokens, ``prompt_logprobs=k``; ``kwargs`` set other fields or override these."""
    fields: dict[str, Any] = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    return SamplingParams(**{**fields, "prompt_logprobs": k, **kwargs})


def assert_matches_transformers(
    prompt_logprobs: PromptLogprobs | None, prompt: list[int], ref: HFReference, k: int
) -> None:
    """Entry i > 0: the prompt token's logprob and rank, and the top k, of transformers'
    log-softmax at position i - 1 (within 1e-4; the same ids and ranks)."""
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    scores = ref.score(tuple(prompt[:1]), tuple(prompt[1:]))  # [P - 1, V]
    for i, entry in enumerate(prompt_logprobs[1:], 1):
        assert entry is not None, i
        row = scores[i - 1]
        token = prompt[i]
        top_lps, top_ids = row.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert set(entry) == {token, *top_ids.tolist()}, i
        want_rank = int((row >= row[token]).sum())
        for rank, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lps.tolist(), strict=True), 1):
            assert entry[tid].rank == rank
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
        if token not in top_ids.tolist():
            assert entry[token].rank == want_rank, i
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4), i


@pytest.mark.parametrize("attention", ["cpu", "torch"])
async def test_chunked_prompt_logprobs_match_transformers_beside_plain_requests(
    attention: str,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    long_prompt = prompt_of(75, seed=1)  # 5 chunks of 16, across 4 block boundaries
    short_prompt = prompt_of(9, seed=2)
    plain = [prompt_of(n, seed=10 + n) for n in (5, 23, 40)]
    results: dict[str, RequestOutput] = {}

    async def one(name: str, prompt: list[int], params: SamplingParams) -> None:
        results[name] = await engine.generate(prompt, params)

    with anyio.fail_after(120):
        async with (
            running_engine(
                path, num_device_blocks=64, max_num_batched_tokens=16, attention_backend=attention
            ) as engine,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(one, "long", long_prompt, plp_params(3))
            tg.start_soon(one, "short", short_prompt, plp_params(5, n=2))
            for i, prompt in enumerate(plain):
                tg.start_soon(one, f"plain{i}", prompt, GREEDY)
    assert_matches_transformers(results["long"].prompt_logprobs, long_prompt, ref, 3)
    assert_matches_transformers(results["short"].prompt_logprobs, short_prompt, ref, 5)
    for name, prompt in (("long", long_prompt), ("short", short_prompt)):
        for completion in results[name].outputs:
            assert completion.token_ids == ref.generate(tuple(prompt), 6)[0]
    for i, prompt in enumerate(plain):
        out = results[f"plain{i}"]
        assert out.prompt_logprobs is None
        assert out.outputs[0].token_ids == ref.generate(tuple(prompt), 6)[0]


async def test_k0_has_the_prompt_token_alone_with_its_text(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompt = prompt_of(20, seed=3)
    async with running_engine(path, num_device_blocks=32) as engine:
        out = await engine.generate(prompt, plp_params(0))
        ids_only = await engine.generate(prompt, plp_params(0, detokenize=False))
        single = await engine.generate(prompt[:1], plp_params(2))
        tokenizer = engine.tokenizer
    assert_matches_transformers(out.prompt_logprobs, prompt, ref, 0)
    assert out.prompt_logprobs is not None
    for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
        assert entry is not None and list(entry) == [token]
        assert entry[token].decoded_token == tokenizer.decode([token])
    assert ids_only.prompt_logprobs is not None
    assert all(e is not None and e[t].decoded_token is None
               for t, e in zip(prompt[1:], ids_only.prompt_logprobs[1:], strict=True))  # fmt: skip
    assert single.prompt_logprobs == [None]


async def test_prefix_cache_hits_never_skip_prompt_positions(
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plp_module, "SLICE_ELEMENTS", 16 * VOCAB_SIZE)  # 16-row slices
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    shared = prompt_of(48, seed=4)
    first, second = shared + prompt_of(5, seed=5), shared + prompt_of(7, seed=6)
    async with running_engine(path, num_device_blocks=64, enable_prefix_caching=True) as engine:
        warm = await engine.generate(first, GREEDY)  # caches the shared blocks
        hit = await engine.generate(second, GREEDY)
        out = await engine.generate(second, plp_params(2))
        again = await engine.generate(first, plp_params(2))
    assert warm.num_cached_tokens == 0 and hit.num_cached_tokens == 48
    assert out.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert_matches_transformers(out.prompt_logprobs, second, ref, 2)
    assert_matches_transformers(again.prompt_logprobs, first, ref, 2)
    assert out.outputs[0].token_ids == hit.outputs[0].token_ids


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async_scheduling"])
async def test_preemption_mid_prefill_recomputes_only_the_unknown_positions(
    ahead: bool,
    tiny_checkpoint: Callable[[str], Path],
    hf_reference: Callable[[str], HFReference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    olds = [prompt_of(15, seed=20 + i) for i in range(3)]
    long_prompt = prompt_of(60, seed=9)
    old_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    asked: list[tuple[int, int, int]] = []  # (chunk start, first row asked, rows asked)
    targets = step_builder.prompt_logprob_targets

    def spy(
        known: int | None, prompt: Sequence[int], start: int, num_new: int
    ) -> tuple[int, tuple[int, ...]]:
        offset, ids = targets(known, prompt, start, num_new)
        if ids:
            asked.append((start, start + offset, len(ids)))
        return offset, ids

    monkeypatch.setattr(step_builder, "prompt_logprob_targets", spy)
    results: dict[int, RequestOutput] = {}

    async def one(i: int, prompt: list[int], params: SamplingParams) -> None:
        results[i] = await engine.generate(prompt, params)

    with anyio.fail_after(120):
        async with running_engine(
            path,
            num_device_blocks=8,
            max_num_batched_tokens=8,
            preemption_mode="recompute",
            async_scheduling=ahead,
        ) as engine:
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(olds):
                    tg.start_soon(one, i, prompt, old_params)
                while engine.statistics().num_running < len(olds):
                    await anyio.sleep(0.005)
                # The newest request: preempted while its prefill is chunked 8 tokens a step.
                tg.start_soon(one, 3, long_prompt, plp_params(2, max_tokens=4))
            stats = engine.statistics()
    assert stats.num_recomputes > 0
    assert any(first > start for start, first, _ in asked)  # a recomputed chunk skipped some
    rows = sorted((first, first + n) for _, first, n in asked)
    assert [a for a, _ in rows] == [0, *(b for _, b in rows[:-1])]  # each row once, none left
    assert rows[-1][1] == len(long_prompt) - 1
    assert_matches_transformers(results[3].prompt_logprobs, long_prompt, ref, 2)
    assert results[3].outputs[0].token_ids == ref.generate(tuple(long_prompt), 4)[0]
    for i, prompt in enumerate(olds):
        assert results[i].outputs[0].token_ids == ref.generate(tuple(prompt), 40)[0]


async def test_delta_carries_them_once_and_final_only_at_the_end(
    tiny_checkpoint: Callable[[str], Path], hf_reference: Callable[[str], HFReference]
) -> None:
    path, ref = tiny_checkpoint(MODEL), hf_reference(MODEL)
    prompt = prompt_of(40, seed=7)
    async with running_engine(path, num_device_blocks=32, max_num_batched_tokens=16) as engine:
        delta = plp_params(2, output_kind=RequestOutputKind.DELTA)
        deltas = [out async for out in engine.generate(prompt, delta)]
        final = plp_params(2, output_kind=RequestOutputKind.FINAL_ONLY)
        finals = [out async for out in engine.generate(prompt, final)]
        cumulative = [out async for out in engine.generate(prompt, plp_params(2))]
    assert len(deltas) > 1
    assert_matches_transformers(deltas[0].prompt_logprobs, prompt, ref, 2)
    assert all(out.prompt_logprobs == [] for out in deltas[1:])
    merged = deltas[0]
    for out in deltas[1:]:
        merged.add(out, aggregate=True)
    assert merged.prompt_logprobs == deltas[0].prompt_logprobs
    assert len(finals) == 1
    assert finals[0].prompt_logprobs == deltas[0].prompt_logprobs
    assert all(out.prompt_logprobs == deltas[0].prompt_logprobs for out in cumulative)


async def test_prompt_logprobs_over_the_limit_are_refused(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    with pytest.raises(InvalidRequestError, match="non-negative"):
        SamplingParams(prompt_logprobs=-1)
    async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=16) as engine:
        with pytest.raises(InvalidRequestError, match="prompt logprobs of 21, which is greater"):
            engine.generate([5, 6, 7], SamplingParams(prompt_logprobs=21))
        with pytest.raises(InvalidRequestError, match="sample logprobs of 30"):
            engine.generate([5, 6, 7], SamplingParams(logprobs=30))
        assert (await engine.generate([5, 6, 7], plp_params(20))).prompt_logprobs is not None


def test_pool_allocate_without_reading_the_cache_registers_its_blocks() -> None:
    pool = BlockPool(num_device_blocks=16, num_host_blocks=0, block_size=4,
                     enable_prefix_caching=True)  # fmt: skip
    prompt = list(range(10, 20))
    first = pool.allocate("a", prompt)
    assert first is not None
    assert pool.num_blocks_to_allocate(prompt) == 1  # two full blocks would be hits
    assert pool.num_blocks_to_allocate(prompt, read_cache=False) == 3
    second = pool.allocate("b", prompt, read_cache=False)
    assert second is not None and second.num_cached_tokens == 0
    assert not set(second.block_ids) & set(first.block_ids)
    pool.free("a")
    third = pool.allocate("c", prompt)  # a's blocks (registered first) are still found
    assert third is not None and third.num_cached_tokens == 8
    pool.free("b")
    pool.free("c")
    pool.check_invariants()


def test_targets_skip_known_positions_and_stop_before_the_last_token() -> None:
    state = RequestState("r", None, plp_params(1), 0.0)
    prompt = list(range(100, 110))
    state.start(prompt, tokenizer=None)
    targets = step_builder.prompt_logprob_targets
    assert targets(1, prompt, 0, 4) == (0, tuple(prompt[1:5]))  # rows 0-3
    top = (((7, -0.5),),) * 4
    rows = PromptLogprobRows(seq_id=1, first_position=1, token_ids=tuple(prompt[1:5]),
                             logprobs=(-1.0,) * 4, ranks=(3,) * 4, top=top)  # fmt: skip
    assert not state.add_prompt_logprobs(rows, tokenizer=None)
    assert state.prompt_logprobs is not None
    known = len(state.prompt_logprobs)  # what the scheduler actor counts: position 0 and 1-4
    assert known == 5
    assert targets(known, prompt, 0, 6) == (4, (prompt[5], prompt[6]))  # recomputed
    assert targets(known, prompt, 4, 6) == (0, tuple(prompt[5:10]))  # row 9 samples
    assert targets(known, prompt, 10, 1) == (0, ())  # a decode
    assert state.prompt_logprobs[1] == {
        101: Logprob(-1.0, 3, None),
        7: Logprob(-0.5, 1, None),
    }
    assert targets(None, prompt, 0, 10) == (0, ())  # not asked
