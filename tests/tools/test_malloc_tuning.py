"""The malloc settings the command line applies: in this process, and in every bench worker."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

from asyncpaged.tools.bench_engines import worker_env
from asyncpaged.tools.malloc_tuning import MALLOC_ENV, THRESHOLD_BYTES, tune_this_process


def test_worker_env_sets_or_clears_the_tunables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")  # inherited from the parent
    tuned = worker_env(1, malloc_tuning=True)
    assert {k: tuned[k] for k in MALLOC_ENV} == {
        "MALLOC_MMAP_THRESHOLD_": str(THRESHOLD_BYTES),
        "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD_BYTES),
    }
    plain = worker_env(1, malloc_tuning=False)
    assert not set(MALLOC_ENV) & set(plain)
    assert plain["OMP_NUM_THREADS"] == "1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_tune_this_process_applies_on_glibc() -> None:
    # in a child, so this test process keeps glibc's defaults
    code = "from asyncpaged.tools.malloc_tuning import tune_this_process as t; print(t())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_without_a_c_library_nothing_is_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert tune_this_process() is False
