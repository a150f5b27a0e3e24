"""Kernel tests run the Triton kernels under the interpreter on the CPU (``TRITON_INTERPRET=1``).

Triton decides interpret-vs-compile when a kernel is decorated and reads the variable again at
launch (it lazily imports modules that assert it), so it is set here for the whole pytest process,
before the kernel modules are imported; if another test folder imported them first they are
re-imported. Nothing outside ``asyncpaged.kernels`` uses Triton, and ``pytest tests`` passes with
it set. ``ASYNCPAGED_KERNELS_NATIVE=1`` on a CUDA machine (``scripts/gpu_check.sh``) compiles the
same kernels natively instead.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

NATIVE = os.environ.get("ASYNCPAGED_KERNELS_NATIVE") == "1"
_MODULES = (
    "asyncpaged.kernels._util",
    "asyncpaged.kernels.cache_ops",
    "asyncpaged.kernels.paged_attention",
    "asyncpaged.kernels.backend",
    "asyncpaged.kernels.triton_quant_matmul",
    "asyncpaged.kernels",
)


def _import_kernels(interpret: bool) -> None:
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    # Reload what an earlier test folder imported (the package imports its submodules lazily,
    # so any subset may be loaded); what is not loaded yet imports with the variable set.
    stale = [name for name in _MODULES if name in sys.modules]
    importlib.import_module("asyncpaged.kernels")
    for name in stale:
        importlib.reload(sys.modules[name])


_import_kernels(interpret=not NATIVE)


@pytest.fixture(scope="session")
def device() -> torch.device:
    if NATIVE:
        if not torch.cuda.is_available():
            pytest.fail("ASYNCPAGED_KERNELS_NATIVE=1 needs a CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture(params=("avx512", "avx2", "baseline"))
def target(request: pytest.FixtureRequest) -> str:
    """Each build target of the native CPU kernels that this CPU runs (a skip names what is
    missing: the CPU's flags, or g++); a target that should build and does not fails."""
    from asyncpaged.kernels import cpu_build

    name: str = request.param
    assert name in cpu_build.TARGETS
    missing = cpu_build.missing_cpu_flags(name)
    if missing:
        pytest.skip(f"this CPU cannot run the {name} build: lacks {sorted(missing)}")
    if cpu_build.find_compiler() is None:
        pytest.skip("g++ not found")
    assert cpu_build.load_library(name) is not None, f"the {name} build failed (see the log)"
    return name
