"""The server mounted in a host app (examples/fastapi_mount.py) and ``asyncpaged serve``."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from asyncpaged.tools.serve import BUILTIN_MODEL_NAME
from tests.server.conftest import builtin_model, live_app

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_mounts_the_server_next_to_the_hosts_routes() -> None:
    spec = importlib.util.spec_from_file_location("fastapi_mount", ROOT / "examples" /
                                                  "fastapi_mount.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    app = example.build_app(str(builtin_model()))
    with live_app(lambda _: app, None, lifespan="on") as live:
        client = openai.OpenAI(base_url=live.base_url + "/llm/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["demo"]
        out = client.completions.create(model="demo", prompt="The return statement",
                                        max_tokens=6, temperature=0)  # fmt: skip
        assert out.choices[0].text and out.usage is not None
        assert out.usage.completion_tokens == 6 or out.choices[0].finish_reason == "stop"
        home = httpx.get(live.base_url + "/").json()
        assert home["app"] == "host" and home["finished"] == 1
        assert "blocks.json" in httpx.get(live.base_url + "/llm/blocks").text
        blocks = httpx.get(live.base_url + "/llm/blocks.json").json()
        assert blocks["device"]["counts"]["used"] == 0 and blocks["requests"] == []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143)], ids=["sigterm"])
def test_asyncpaged_serve_answers_and_stops_on_a_signal(signum: int, status: int) -> None:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "asyncpaged", "serve", "--port", str(port),
               "--num-device-blocks", "64", "--max-num-seqs", "4"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "asyncpaged serve did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == [BUILTIN_MODEL_NAME]
        chat = client.chat.completions.create(
            model=BUILTIN_MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4, temperature=0,
        )  # fmt: skip
        assert chat.choices[0].message.role == "assistant"
        assert httpx.get(base + "/blocks.json").json()["device"]["num_blocks"] == 64
    finally:
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == status, err
    assert f"serving '{BUILTIN_MODEL_NAME}' on {base}/v1" in err


def test_serve_takes_the_kv_size_options_as_vllm_names_them() -> None:
    import argparse

    from asyncpaged.tools.serve import add_parser, engine_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--device", "cuda",
                              "--gpu-memory-utilization", "0.7"])  # fmt: skip
    config = engine_config(args)
    assert (config.device, config.gpu_memory_utilization, config.kv_cache_bytes) == (
        "cuda",
        0.7,
        None,
    )
    plain = engine_config(parser.parse_args(["serve", "--model", "m", "--kv-cache-mib", "64"]))
    assert (plain.gpu_memory_utilization, plain.kv_cache_bytes) == (0.9, 64 << 20)
