"""The library's logging manners: events go through the stdlib logger ``asyncpaged`` and the
host's logging configuration decides what shows; the library configures nothing global."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import structlog
from structlog.testing import capture_logs

from asyncpaged._log import get_logger

_GENERATE = """
import anyio
from asyncpaged import AsyncEngine, EngineConfig, SamplingParams, default_model

async def main() -> None:
    config = EngineConfig(model=str(default_model.path()), num_device_blocks=32)
    async with AsyncEngine(config) as engine:
        out = await engine.generate("The return", SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 4

anyio.run(main)
"""


def _run(setup: str, body: str = _GENERATE) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(setup) + body
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )


def test_a_warning_level_host_sees_nothing_of_a_generation() -> None:
    done = _run("import logging\nlogging.basicConfig(level=logging.WARNING)\n")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_an_unconfigured_host_sees_nothing_of_a_generation() -> None:
    done = _run("")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_a_debug_level_host_gets_the_events_through_its_handler() -> None:
    done = _run(
        """
        import logging, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                            format="HOST %(levelname)s %(name)s | %(message)s")
        for noisy in ("urllib3", "filelock", "httpx", "transformers"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        """
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(
        line.startswith("HOST DEBUG asyncpaged.actors.scheduler | request_added actor='scheduler'")
        for line in lines
    ), done.stdout
    assert any(line.startswith("HOST INFO asyncpaged.engine | engine_started") for line in lines)
    assert "request_added" not in done.stderr  # nothing beside the host's handler


def test_the_runner_process_events_go_through_the_hosts_handler() -> None:
    """With the runner in its own process, what it logs (here the packed linears it builds
    at load) reaches the host's handler in the engine's process (worker/runner_logs.py), and
    nothing of it goes to the runner's stderr."""
    body = _GENERATE.replace("num_device_blocks=32", "num_device_blocks=32, "
                             "executor_backend='process', packed_linears=True")  # fmt: skip
    done = _run(
        """
        import logging, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                            format="HOST %(levelname)s %(name)s %(processName)s | %(message)s")
        for noisy in ("urllib3", "filelock", "httpx", "transformers"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        """,
        body,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(
        line.startswith("HOST DEBUG asyncpaged.model.packed_linear asyncpaged-runner | "
                        "packed_linears count=")
        or line.startswith("HOST INFO asyncpaged.model.packed_linear asyncpaged-runner | "
                           "packed_linears_unavailable")
        for line in lines
    ), done.stdout  # fmt: skip
    assert done.stderr == ""


def test_the_tensor_parallel_ranks_load_events_go_through_the_hosts_handler() -> None:
    """Under TP=2 rank 1 loads in its own process: the events of its load (its packed
    linears, its ready report) come to rank 0 with its report and reach the host's handler,
    named after the rank; nothing of them goes to its stderr."""
    body = _GENERATE.replace("num_device_blocks=32", "num_device_blocks=32, "
                             "tensor_parallel_size=2, packed_linears=True")  # fmt: skip
    done = _run(
        """
        import logging, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                            format="HOST %(levelname)s %(name)s %(processName)s | %(message)s")
        for noisy in ("urllib3", "filelock", "httpx", "transformers", "torch"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        """,
        body,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rank1 = [line for line in lines if " asyncpaged-tp-rank-1 | " in line]
    assert any(" packed_linears" in line for line in rank1), done.stdout
    assert any(
        line.startswith("HOST DEBUG asyncpaged.distributed.worker asyncpaged-tp-rank-1 | "
                        "tp_worker_ready")
        for line in rank1
    ), done.stdout  # fmt: skip
    assert "packed_linears" not in done.stderr and "tp_worker_ready" not in done.stderr


def test_an_unconfigured_host_still_sees_warnings_on_stderr() -> None:
    """The documented choice: no NullHandler, so stdlib's last-resort handler shows warnings."""
    done = _run(
        "",
        body="from asyncpaged._log import get_logger\n"
        "get_logger('asyncpaged.model').warning('generation_default_ignored', field='top_p')\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr == "generation_default_ignored field='top_p'\n"


def test_events_become_stdlib_records(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("asyncpaged.actors.test").bind(actor="test")
    with caplog.at_level(logging.INFO, logger="asyncpaged"):
        log.debug("hidden_below_info", n=0)
        log.info("request_added", request_id="r1", n=2)
        try:
            raise KeyError("k")
        except KeyError:
            log.exception("step_failed")
    assert [r.getMessage() for r in caplog.records] == [
        "request_added actor='test' request_id='r1' n=2",
        "step_failed actor='test'",
    ]
    first, second = caplog.records
    assert (first.name, first.levelname) == ("asyncpaged.actors.test", "INFO")
    assert first.event == "request_added"  # type: ignore[attr-defined]
    assert first.event_fields == {"actor": "test", "request_id": "r1", "n": 2}  # type: ignore[attr-defined]
    assert second.levelname == "ERROR" and second.exc_info is not None
    assert get_logger("kernels.cpu_build")._name == "asyncpaged.kernels.cpu_build"


def test_nothing_global_is_configured() -> None:
    import asyncpaged  # noqa: F401  (every library module is imported by now in this process)

    get_logger("asyncpaged").warning("probe_event")
    assert not structlog.is_configured()
    assert logging.getLogger("asyncpaged").handlers == []
    assert logging.getLogger("asyncpaged").level == logging.NOTSET


def test_a_host_that_configures_structlog_gets_the_events_there() -> None:
    with capture_logs() as logs:
        get_logger("asyncpaged.engine").bind(actor="a").info("engine_started", model="m")
    assert logs == [{"event": "engine_started", "actor": "a", "model": "m", "log_level": "info"}]
