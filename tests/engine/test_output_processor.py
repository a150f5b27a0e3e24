"""The output processor (``actors/output_processor.py``): the one writer of every request's
output state. Its protocol with hand-built messages (a stop check holds and answers, the next
delivery releases; ends by abort and by error), and in a live engine: a stop string ends its
sequence before the next step is computed, detokenizing runs on the loop's tokenizer (never
the intake's, which its thread may be using), and the messages between actors are immutable."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpaged import SamplingParams
from asyncpaged.actors import messages
from asyncpaged.actors.messages import (
    EndRequest,
    OutputsInbox,
    PromptReady,
    RecordOutputs,
    Scheduled,
    StopsFound,
)
from asyncpaged.actors.output_processor import OutputProcessor
from asyncpaged.errors import RequestFailedError
from asyncpaged.sampled_token import SampledToken
from asyncpaged.sampling_params import RequestOutputKind
from asyncpaged.sched.scheduler import EngineCoreOutput
from asyncpaged.streams import RequestState
from tests.engine.conftest import running_engine

pytestmark = pytest.mark.anyio

MODEL = "llama-gqa"


class CharTokenizer:
    """Token id i is the character chr(ord('a') + i % 26): enough to detokenize stop strings."""

    def __len__(self) -> int:
        return 512

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _token(rid: str, ids: tuple[int, ...], finish: str | None = None) -> EngineCoreOutput:
    row = SampledToken(seq_id=0, token_id=ids[-1], logprob=None)
    return EngineCoreOutput(request_id=rid, seq_id=0, completion=0, new_token_ids=ids,
                            finish_reason=finish, stop_reason=None, sampled=row)  # fmt: skip


async def test_a_stop_check_holds_answers_and_the_next_delivery_releases() -> None:
    inbox_send, inbox = anyio.create_memory_object_stream[OutputsInbox](math.inf)
    replies, replies_recv = anyio.create_memory_object_stream[StopsFound](1)
    outputs = OutputProcessor(inbox, replies, CharTokenizer())
    stop = RequestState("s", None, SamplingParams(stop=["cd"], max_tokens=20), 0.0)
    plain = RequestState("p", None, SamplingParams(max_tokens=20), 0.0)
    outputs.register(stop)
    outputs.register(plain)
    async with inbox_send, replies_recv, anyio.create_task_group() as tg:
        tg.start_soon(outputs.run)
        for state in (stop, plain):
            inbox_send.send_nowait(PromptReady(request_id=state.request_id, prompt=None,
                                               prompt_token_ids=(0, 1)))  # fmt: skip
        inbox_send.send_nowait(RecordOutputs(tokens=(_token("s", (0, 1, 2)),), check_stops=True))
        with anyio.fail_after(5):
            verdict = await replies_recv.receive()
        assert verdict.matches == (), "abc holds no stop string"
        assert not stop._has_news(RequestOutputKind.DELTA), "a checked state is held"
        assert not outputs.is_idle
        inbox_send.send_nowait(RecordOutputs(tokens=(_token("s", (3, 4)),), check_stops=True))
        with anyio.fail_after(5):
            verdict = await replies_recv.receive()
        assert verdict.matches == (("s", 0, "cd"),)
        assert stop.completions[0].finish_reason == "stop" and stop.completions[0].text == "ab"
        assert not stop._has_news(RequestOutputKind.DELTA), "still held: blocks not yet freed"
        scheduled = Scheduled(request_id="p", first_scheduled_time=1.5, num_cached_tokens=16)
        inbox_send.send_nowait(RecordOutputs(tokens=(_token("p", (7,), "length"),),
                                             scheduled=(scheduled,)))  # fmt: skip
        with anyio.fail_after(5):
            await outputs.wait_idle()
        assert stop._has_news(RequestOutputKind.DELTA), "released by the delivery"
        assert plain.finished and plain.completions[0].text == "h"
        assert plain.metrics.first_scheduled_time == 1.5 and plain.num_cached_tokens == 16
        assert not outputs.live, "finished requests leave the registry"
        tg.cancel_scope.cancel()


async def test_ends_by_abort_and_by_error_reach_the_waiter() -> None:
    inbox_send, inbox = anyio.create_memory_object_stream[OutputsInbox](math.inf)
    replies, replies_recv = anyio.create_memory_object_stream[StopsFound](1)
    outputs = OutputProcessor(inbox, replies, None)
    aborted = RequestState("a", None, SamplingParams(), 0.0)
    failed = RequestState("f", None, SamplingParams(), 0.0)
    outputs.register(aborted)
    outputs.register(failed)
    async with inbox_send, replies_recv, anyio.create_task_group() as tg:
        tg.start_soon(outputs.run)
        error = RequestFailedError("its logits processor raised")
        inbox_send.send_nowait(EndRequest(request_id="a"))
        inbox_send.send_nowait(EndRequest(request_id="f", error=error))
        inbox_send.send_nowait(EndRequest(request_id="gone"))  # an end for no one: ignored
        with anyio.fail_after(5):
            await outputs.wait_idle()
            await aborted.wait(RequestOutputKind.FINAL_ONLY)
            with pytest.raises(RequestFailedError):
                await failed.wait(RequestOutputKind.FINAL_ONLY)
        assert aborted.completions[0].finish_reason == "abort"
        assert not outputs.live
        tg.cancel_scope.cancel()


def test_the_messages_between_actors_are_frozen() -> None:
    classes = [c for c in vars(messages).values()
               if isinstance(c, type) and dataclasses.is_dataclass(c)
               and c.__module__ == messages.__name__]  # fmt: skip
    assert len(classes) >= 15
    for cls in classes:
        assert cls.__dataclass_params__.frozen, cls.__name__  # type: ignore[attr-defined]


async def test_a_stop_string_ends_its_sequence_before_the_next_step(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """No step computes past a stop string: the stopped request is in exactly as many
    sampling rows as it has output tokens (one more would be a token computed and dropped)."""
    async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=32) as engine:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        text = (await engine.generate("the block table", greedy)).outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip() and stop in text
        runner = engine._executor.runner
        execute = runner.execute
        rows: list[int] = []

        def spy(plan: Any) -> Any:
            rows.extend(s.seq_id for s in plan.seqs if s.do_sample)
            return execute(plan)

        runner.execute = spy  # type: ignore[method-assign]
        params = dataclasses.replace(greedy, stop=(stop,))
        cut = await engine.generate("the block table", params)  # alone: every row is its own
        runner.execute = execute  # type: ignore[method-assign]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert len(set(rows)) == 1
    assert len(rows) == len(cut.outputs[0].token_ids) < greedy.max_tokens


async def test_detokenizing_uses_the_loop_tokenizer_not_the_intakes(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The intake's tokenizer copy runs on its worker thread; a detokenizer built on it would
    decode on the loop while that thread encodes (fast tokenizers are not re-entrant)."""
    async with running_engine(tiny_checkpoint(MODEL), num_device_blocks=32) as engine:
        assert engine._intake_tokenizer is not engine.tokenizer
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)  # fmt: skip
        stream = engine.generate("the block table", params)
        seen = []
        async for out in stream:
            assert engine._outputs is not None
            state = engine._outputs.live.get(stream.request_id)
            if state is not None:
                detokenizer = state.completions[0].detokenizer
                assert detokenizer is not None
                seen.append(detokenizer._tokenizer)
            if out.finished:
                break
        assert seen and all(t is engine.tokenizer for t in seen)
