"""The synchronous ``LLM``: outputs in prompt order, a progress bar, errors to the caller."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncpaged import (
    LLM,
    EngineClosedError,
    EngineConfig,
    InvalidRequestError,
    SamplingParams,
    default_model,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = ["The return statement", "A list", "The with statement", "Raise"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(default_model.path(), num_device_blocks=64) as llm:
        yield llm


def test_generate_returns_outputs_in_prompt_order(
    llm: LLM, capfd: pytest.CaptureFixture[str]
) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    assert all(o.finished and len(o.outputs[0].token_ids) == 6 for o in outs)
    assert "4/4" in capfd.readouterr().err  # the progress bar
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in reversed(PROMPTS)]
    assert [o.outputs[0].token_ids for o in reversed(alone)] == [
        o.outputs[0].token_ids for o in outs
    ]
    assert capfd.readouterr().err == ""


def test_one_params_per_prompt_and_token_prompts(llm: LLM) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 3)]
    outs = llm.generate([[1, 5, 6], "Two", {"prompt_token_ids": [1, 7]}], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    (single,) = llm.generate([1, 5, 6], params[0], use_tqdm=False)  # one prompt of token ids
    assert single.prompt_token_ids == [1, 5, 6]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], params[:2])


def test_chat_one_conversation_or_several(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "What does return do?"}]
    (one,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert one.prompt is not None and one.prompt.endswith("Assistant:")
    two = llm.chat([conversation, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids


def test_errors_reach_the_caller_and_the_llm_goes_on(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(["fine", [1] * 600], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"too long|max_model_len"):
        llm.generate("word " * 600, GREEDY, use_tqdm=False)  # found after tokenizing
    assert llm.generate("fine", GREEDY, use_tqdm=False)[0].finished
    llm.engine.statistics()
    assert llm.engine.statistics().num_running == 0


def _threads_settle(before: set[threading.Thread], timeout: float = 5.0) -> bool:
    """No thread beyond ``before`` within ``timeout``: the LLM's loop thread is joined by
    close(), and anyio's worker threads of that loop, told to stop when it ends, exit soon
    after (not joined by anyio)."""
    deadline = time.monotonic() + timeout
    while not set(threading.enumerate()) <= before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_close_stops_the_thread_and_refuses_later_calls() -> None:
    config = EngineConfig(model=str(default_model.path()), num_device_blocks=16)
    before = set(threading.enumerate())
    llm = LLM(config, max_num_seqs=4)
    assert llm.engine.config.max_num_seqs == 4
    llm.close()
    llm.close()  # again: nothing
    assert _threads_settle(before)
    with pytest.raises(EngineClosedError):
        llm.generate("x", GREEDY)


def test_a_failed_start_raises_and_leaves_no_thread(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    with pytest.raises(Exception, match="no-such-checkpoint"):
        LLM(tmp_path / "no-such-checkpoint")
    assert _threads_settle(before)
