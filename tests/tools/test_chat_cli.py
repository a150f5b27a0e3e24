"""``asyncpaged chat`` on the built-in model: streamed multi-turn replies from piped input."""

from __future__ import annotations

import argparse
import io

import anyio
from transformers import AutoTokenizer

from asyncpaged import default_model
from asyncpaged.tools.chat import run_chat


def _args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {"model": None, "revision": None, "system": None,
                                 "max_tokens": 12, "temperature": 0.0, "top_p": None,
                                 "top_k": None, "seed": None}  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def test_builtin_model_has_a_chat_template() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(default_model.path()))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<s>User: Hi</s><s>Assistant:"


def test_chat_cli_streams_a_conversation() -> None:
    stdin = io.StringIO("What does return do?\n\n/reset\nAnd yield?\nAnd with?\n")
    out = io.StringIO()
    args = _args(system="You answer from the Python docs.")
    assert anyio.run(lambda: run_chat(args, stdin, out)) == 0
    text = out.getvalue()
    assert text.count("assistant> ") == 3
    assert text.count("user> ") == 6  # five lines read, then end of input
    # After /reset, two turns: the second turn's prompt starts with the first turn's.
    assert "4 messages; prefix cache hit" in text
    hit = int(text.rsplit("prefix cache hit ", 1)[1].split(" ", 1)[0])
    assert hit >= 16


def test_chat_cli_reports_an_error_and_goes_on() -> None:
    stdin = io.StringIO("Hi\n/exit\nnot read\n")
    out = io.StringIO()
    assert anyio.run(lambda: run_chat(_args(max_tokens=600), stdin, out)) == 0
    assert "error: " in out.getvalue()  # 600 tokens do not fit the model's 512 positions
    assert "0 messages" in out.getvalue()
