"""Test-wide settings: Hypothesis profiles, and running under pytest-xdist.

CI uses the derandomized ``ci`` profile; ``ASYNCPAGED_HYPOTHESIS_PROFILE=long`` selects a longer,
randomized search (``dev`` is a quick one for editing).

The suite runs on pytest-xdist workers (``addopts`` in pyproject.toml). What keeps it safe there:
each worker builds its own tiny checkpoints (session fixtures under its own ``tmp_path``), servers
bind port 0, the native CPU kernels build into the shared cache folder under a file lock
(``asyncpaged.kernels.cpu_build``: one process compiles, the others wait and load it), and every
worker sets ``TRITON_INTERPRET`` itself when it imports tests/kernels/conftest.py during collection,
before any kernel test runs. Two more things are here: each worker gets its share of the cores
(torch threads), and tests marked ``alone`` run while no other worker runs a test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

# Triton decides interpreted or compiled when triton.language is first imported, and other test
# folders import it before tests/kernels/conftest.py loads (peft and transformers' generation
# import it through torch._dynamo): the interpreter is set here first (tests/kernels/conftest.py
# says why; ASYNCPAGED_KERNELS_NATIVE=1 compiles instead, on a CUDA machine).
if os.environ.get("ASYNCPAGED_KERNELS_NATIVE") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
from hypothesis import HealthCheck, settings

from asyncpaged.tools import cli_log

settings.register_profile(
    "ci",
    max_examples=500,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=3000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=30, stateful_step_count=30, deadline=None)
settings.load_profile(os.environ.get("ASYNCPAGED_HYPOTHESIS_PROFILE", "ci"))

# "auto" (asyncpaged serve's default) runs the model in a thread here unless a test asks for
# the runner's process (~3 s more per start). The examples and served apps, run as scripts,
# inherit it. tests/engine/test_runner_process.py covers the process, and "auto" with this
# variable taken out.
os.environ.setdefault("ASYNCPAGED_EXECUTOR_BACKEND", "thread")


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Every test draws from seeded generators: torch's, numpy's and ``random``'s global ones
    start from a seed of the test's id, so a test that draws without a generator of its own
    (a layer's default init, ``torch.randn``) draws the same numbers on every run and worker."""
    import numpy as np

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """The command line configures logging (it is an application); undo it after each test."""
    yield
    structlog.reset_defaults()
    cli_log.reset()


# --- pytest-xdist ---------------------------------------------------------------------------------

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... in a worker; None otherwise
if _WORKER is not None:
    # Each worker its share of the cores: two workers of torch's default (every core) thread
    # pool oversubscribe the machine, and OpenMP's spinning threads then stall each other. The
    # tests that need threads pass ``num_threads`` explicitly; tests/model and the server
    # fixtures pin 1 thread anyway.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _workers))


class _RunLock:
    """A readers-writer lock shared by this run's workers (``flock`` on two files in the run's
    temporary folder): every test holds it shared, an ``alone`` test exclusively. The gate keeps
    an ``alone`` test from waiting forever: a worker takes it before the run lock, and an
    ``alone`` test keeps it until it ends, so no new test starts meanwhile."""

    def __init__(self, folder: Path) -> None:
        flags = os.O_RDWR | os.O_CREAT
        self._gate = os.open(folder / "xdist-gate.lock", flags, 0o644)
        self._run = os.open(folder / "xdist-run.lock", flags, 0o644)

    @contextlib.contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._run, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._gate, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def _run_lock(tmp_path_factory: pytest.TempPathFactory) -> _RunLock | None:
    if _WORKER is None:
        return None  # one process: nothing runs beside a test
    # A worker's basetemp is <the run's basetemp>/<worker id>: the parent is shared by the run.
    return _RunLock(tmp_path_factory.getbasetemp().parent)


@pytest.fixture(autouse=True)
def _alone_under_xdist(
    request: pytest.FixtureRequest, _run_lock: _RunLock | None
) -> Iterator[None]:
    """Tests marked ``alone`` (they measure latency or time) run while no other worker runs a
    test; the others may run side by side. A no-op without xdist workers."""
    if _run_lock is None:
        yield
        return
    with _run_lock.hold(alone=request.node.get_closest_marker("alone") is not None):
        yield
