"""The versions an engine runs with: logged once as an engine starts (``engine_versions``) and
printed by ``asyncpaged --version``, so a report of different tokens or speed says what ran.

Distributions are read from their metadata (nothing heavy is imported); the native CPU kernels are
named by their build: the target the CPU selects and the hash of the sources, flags and compiler
that names the cached library (``asyncpaged.kernels.cpu_build``).
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

__version__ = "0.1.0"  # pyproject.toml's; ``asyncpaged.__version__``

# What the engine's results depend on, in the order they are printed; optional ones say
# "not installed".
DISTRIBUTIONS = ("asyncpaged", "torch", "transformers", "tokenizers", "safetensors", "numpy",
                 "xgrammar", "triton", "kernels")  # fmt: skip
NOT_INSTALLED = "not installed"


def distribution_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``"not installed"``."""
    try:
        return version(name)
    except PackageNotFoundError:
        if name == "asyncpaged":  # a source tree that is not installed
            return __version__
        return NOT_INSTALLED


def runtime_versions() -> dict[str, str]:
    """Python, the distributions of ``DISTRIBUTIONS`` and the native CPU kernels' build
    (``cpu_kernels``: ``"<target> <hash>"``, or why there is none)."""
    from asyncpaged.kernels import cpu_build

    found = {"python": platform.python_version()}
    found.update({name: distribution_version(name) for name in DISTRIBUTIONS})
    found["cpu_kernels"] = cpu_build.build_id()
    return found


def version_text() -> str:
    """``asyncpaged --version``: one ``name version`` line each."""
    versions = runtime_versions()
    width = max(map(len, versions))
    return "\n".join(f"{name:<{width}}  {value}" for name, value in versions.items())
