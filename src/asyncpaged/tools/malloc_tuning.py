"""glibc malloc settings that keep a CPU engine's freed activations for reuse.

Each model step allocates its activations afresh (GEMM outputs of up to ~11 MB on the
benchmark model). glibc serves large blocks with ``mmap`` and hands freed heap memory back to the
kernel, so the next step faults the same pages in again and the kernel zeroes them. Raising
the mmap and trim thresholds keeps those blocks in the heap: the reference workload took
~25% fewer page faults and ran ~2-3% faster (docs/tuning.md). The price is that memory freed
after a peak stays with the process.

These are process-wide settings, so the library never applies them by itself: the command line
does (``asyncpaged demo``, ``generate`` and every ``bench`` worker, baselines included), and a host
can set the same environment variables before starting Python or call :func:`tune_this_process`.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from asyncpaged._log import get_logger

_log = get_logger(__name__)

THRESHOLD_BYTES = 1 << 30
# glibc's tunables, read when a process starts (the trailing underscores are part of the names)
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(THRESHOLD_BYTES),
    "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD_BYTES),
}
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3


def tune_this_process() -> bool:
    """Apply the settings to this running process (glibc only); False where they cannot be."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES)
    )
    _log.debug("malloc_tuned", ok=ok, threshold_bytes=THRESHOLD_BYTES)
    return ok
