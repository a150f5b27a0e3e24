"""``asyncpaged serve``'s flags (vLLM's spellings) parsed into ``EngineConfig`` and
``create_app``'s options, without starting a server."""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import pytest

from asyncpaged.server import create_app
from asyncpaged.server import limits as server_limits
from asyncpaged.spec_decode.config import SpeculativeConfig
from asyncpaged.tools import serve
from asyncpaged.tools.serve import API_KEY_ENV, add_parser, app_options, engine_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", "m", *argv])


def test_vllm_spellings_map_onto_engine_config() -> None:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    config = engine_config(
        _parse(
            "--tensor-parallel-size",
            "2",
            "--kv-cache-dtype",
            "bfloat16",
            "--max-model-len",
            "256",
            "--speculative-config",
            spec,
        )
    )
    assert (config.tensor_parallel_size, config.kv_cache_dtype, config.max_model_len) == (
        2, "bfloat16", 256,
    )  # fmt: skip
    assert config.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=4
    )
    plain = engine_config(_parse())
    assert (plain.tensor_parallel_size, plain.kv_cache_dtype, plain.speculative_config) == (
        1, "auto", None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "parser"),
    [((), "auto"), (("--tool-call-parser", "hermes", "--enable-auto-tool-choice"), "hermes"),
     (("--tool-call-parser", "none"), None)],
)  # fmt: skip
def test_tool_call_parser_flag(argv: tuple[str, ...], parser: str | None) -> None:
    assert engine_config(_parse(*argv)).tool_call_parser == parser


@pytest.mark.parametrize(
    ("argv", "parser"),
    [((), "auto"), (("--reasoning-parser", "qwen3"), "qwen3"),
     (("--reasoning-parser", "none"), None)],
)  # fmt: skip
def test_reasoning_parser_flag(argv: tuple[str, ...], parser: str | None) -> None:
    assert engine_config(_parse(*argv)).reasoning_parser == parser


@pytest.mark.parametrize(
    ("argv", "enabled"),
    [((), True), (("--enable-prefix-caching",), True), (("--no-enable-prefix-caching",), False),
     (("--no-prefix-caching",), False)],
)  # fmt: skip
def test_prefix_caching_flags(argv: tuple[str, ...], enabled: bool) -> None:
    assert engine_config(_parse(*argv)).enable_prefix_caching is enabled


def test_speculative_config_as_vllm_writes_it() -> None:
    draft = engine_config(
        _parse("--speculative-config", '{"model": "draft-dir", "num_speculative_tokens": 2}')
    )
    assert draft.speculative_config == SpeculativeConfig(
        method="draft_model", model="draft-dir", num_speculative_tokens=2
    )
    ngram = engine_config(_parse("--speculative-config",
                                 '{"model": "[ngram]", "num_speculative_tokens": 2}'))  # fmt: skip
    assert ngram.speculative_config is not None and ngram.speculative_config.method == "ngram"


@pytest.mark.parametrize(
    ("value", "message"),
    [("{not json", "not valid JSON"), ("[1]", "JSON object"),
     ('{"method": "eagle", "num_speculative_tokens": 2}', "'ngram' or 'draft_model'"),
     ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
      "unsupported keys"),
     ('{"method": "ngram"}', "num_speculative_tokens")],
)  # fmt: skip
def test_a_bad_speculative_config_is_a_usage_error(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parse("--speculative-config", value)
    assert message in capsys.readouterr().err


def test_app_options_defaults_and_api_key_from_flag_or_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    options = app_options(_parse())
    assert options == {
        "api_key": None,
        "protect_metrics": False,
        "chat_template": None,
        "max_request_bytes": 32 << 20,
        "max_messages": 2048,
        "max_tools": 128,
    }
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert app_options(_parse())["api_key"] == "from-env"
    chosen = app_options(_parse("--api-key", "from-flag", "--protect-metrics",
                                "--max-request-bytes", "1000", "--max-messages", "8",
                                "--max-tools", "4"))  # fmt: skip
    assert chosen == {"api_key": "from-flag", "protect_metrics": True, "chat_template": None,
                      "max_request_bytes": 1000, "max_messages": 8, "max_tools": 4}  # fmt: skip


def test_the_serve_defaults_are_create_apps() -> None:
    """The command line repeats the limits (so that parsing needs no Starlette): the same."""
    defaults = inspect.signature(create_app).parameters
    assert (serve.MAX_REQUEST_BYTES, serve.MAX_MESSAGES, serve.MAX_TOOLS) == (
        server_limits.MAX_REQUEST_BYTES, server_limits.MAX_MESSAGES, server_limits.MAX_TOOLS,
    )  # fmt: skip
    assert defaults["max_request_bytes"].default == serve.MAX_REQUEST_BYTES
    assert set(defaults) >= set(serve.AppOptions.__annotations__)


def test_chat_template_is_a_file_or_an_inline_template(tmp_path: Path) -> None:
    file = tmp_path / "template.jinja"
    file.write_text("{{ messages[0]['content'] }}\n")
    assert app_options(_parse("--chat-template", str(file)))["chat_template"] == (
        "{{ messages[0]['content'] }}\n"
    )
    inline = app_options(_parse("--chat-template", "{{ messages[0]['content'] }}\\nend"))
    assert inline["chat_template"] == "{{ messages[0]['content'] }}\nend"  # \n decoded, as vLLM
    with pytest.raises(ValueError, match="looks like a file path"):
        app_options(_parse("--chat-template", str(tmp_path / "missing.jinja")))
