"""Build the native CPU kernels with g++ on first use, cached on disk, loaded through ctypes.

``load_library(target)`` compiles the sources in ``csrc/`` (``paged_decode.cpp``,
``paged_prefill.cpp``, ``cache_write.cpp``, ``fused_ops.cpp``, ``argmax.cpp``,
``quant_matmul.cpp``, ``scaled_matmul.cpp``, sharing ``cpu_vec.h``) into one shared library for
one build target and returns it loaded, or ``None`` when there is no compiler or the build fails
(a warning is logged once; callers fall back to torch). Targets, best first:

=========  ===========================  ===========================================
target     flags                        CPU needs (``/proc/cpuinfo`` flags)
=========  ===========================  ===========================================
avx512     ``-march=x86-64-v4``, 64 B   the x86-64-v4 set (avx512 f/bw/cd/dq/vl)
avx2       ``-march=x86-64-v3``, 32 B   the x86-64-v3 set (avx2, fma, bmi1/2, ...)
baseline   ``-march=x86-64``, 16 B      nothing (no ``-march`` off x86)
=========  ===========================  ===========================================

The default is the best target the CPU runs; ``ASYNCPAGED_CPU_TARGET`` overrides it (a target
the CPU cannot run is refused with a warning, since it would die on an illegal instruction).

The shared library lives in ``ASYNCPAGED_CACHE_DIR`` (default ``~/.cache/asyncpaged/kernels``),
named by a hash of the sources and headers, the flags, the compiler's version and the target. It
is compiled to a temporary file in that folder and moved into place with ``os.replace``, so
processes that build at the same time never see a partial file; on POSIX they also take a lock on
the folder while building (``flock`` on the folder itself, so no lock file is left behind), so
processes that start together (two engines, test workers) compile each library once: the others
wait and then load the finished file. Nothing here imports Triton.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

from asyncpaged._log import get_logger

log = get_logger(__name__)

TARGETS: Final = ("avx512", "avx2", "baseline")
BUILD_NOTE: Final = "building native CPU kernels (one time, ~15 s)"  # logged with the cache path


def _source_dir() -> Path:
    """Where the C++ sources are: ``asyncpaged/kernels/csrc`` in a wheel, the repository's
    top-level ``kernels/csrc`` in a checkout (an editable install maps no data folder)."""
    here = Path(__file__).resolve().parent
    shipped, checkout = here / "csrc", here.parents[2] / "kernels" / "csrc"
    return shipped if shipped.is_dir() else checkout


_CSRC: Final = _source_dir()
SOURCES: Final = tuple(
    _CSRC / n
    for n in (
        "paged_decode.cpp",
        "paged_prefill.cpp",
        "cache_write.cpp",
        "fused_ops.cpp",
        "argmax.cpp",
        "quant_matmul.cpp",
        "scaled_matmul.cpp",
    )
)
HEADERS: Final = (_CSRC / "cpu_vec.h",)
COMMON_FLAGS: Final = (
    "-O3",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-std=c++17",
    "-ffp-contract=fast",  # strict -std=c++17 turns FMA contraction off otherwise
)
# Vector width (bytes) the source is built for, per target.
VEC_BYTES: Final = {"avx512": 64, "avx2": 32, "baseline": 16}
_X86_V2: Final = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_V3: Final = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
_X86_V4: Final = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_REQUIRED_FLAGS: Final = {"avx512": _X86_V4, "avx2": _X86_V3, "baseline": frozenset[str]()}
_MARCH: Final = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "baseline": "x86-64"}

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # target -> library (None: unavailable)
_warned: set[str] = set()
_compiler_versions: dict[str, str] = {}


@functools.cache
def is_x86() -> bool:
    return platform.machine().lower() in {"x86_64", "amd64"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def supported_targets() -> tuple[str, ...]:
    """The targets this CPU runs, best first (always ends with ``baseline``)."""
    if not is_x86():
        return ("baseline",)
    return _targets_with(cpu_flags())


@functools.cache
def _targets_with(flags: frozenset[str]) -> tuple[str, ...]:
    return tuple(t for t in TARGETS if _REQUIRED_FLAGS[t] <= flags)


def missing_cpu_flags(target: str) -> frozenset[str]:
    """CPU flags ``target`` needs that this CPU lacks (all of them off x86, but baseline)."""
    _check_target(target)
    if not is_x86():
        return frozenset() if target == "baseline" else frozenset({"x86-64"})
    return _REQUIRED_FLAGS[target] - cpu_flags()


def select_target() -> str:
    """``ASYNCPAGED_CPU_TARGET`` if set and runnable here, else the best supported target."""
    supported = supported_targets()
    wanted = os.environ.get("ASYNCPAGED_CPU_TARGET", "").strip()
    if not wanted:
        return supported[0]
    _check_target(wanted)
    if wanted not in supported:
        _warn_once(
            f"target:{wanted}",
            "cpu_kernel_target_refused",
            target=wanted,
            missing_flags=sorted(missing_cpu_flags(wanted)),
            using=supported[0],
        )
        return supported[0]
    return wanted


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "asyncpaged" / "kernels"
    return Path(os.environ.get("ASYNCPAGED_CACHE_DIR") or default)


def find_compiler() -> str | None:
    """The path of ``g++``, or ``None``."""
    return shutil.which("g++")


def compile_flags(target: str) -> tuple[str, ...]:
    _check_target(target)
    march = (f"-march={_MARCH[target]}",) if is_x86() else ()
    return (*COMMON_FLAGS, *march, f"-DASYNCPAGED_VEC_BYTES={VEC_BYTES[target]}")


def library_path(
    source: Path | Sequence[Path],
    target: str,
    compiler: str,
    directory: Path,
    headers: Sequence[Path] = (),
) -> Path:
    """Where the build of ``source`` (one or several files, named after the first) for ``target``
    is cached (the name hashes every input, ``headers`` included)."""
    sources = _as_sources(source)
    digest = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in (*sources, *headers)),
        "\0".join(compile_flags(target)).encode(),
        _compiler_version(compiler).encode(),
        target.encode(),
        platform.machine().encode(),
    ):
        digest.update(hashlib.sha256(part).digest())
    return directory / f"{sources[0].stem}-{target}-{digest.hexdigest()[:20]}.so"


def build(
    source: Path | Sequence[Path],
    target: str,
    directory: Path | None = None,
    headers: Sequence[Path] = (),
) -> Path | None:
    """The cached library of ``source`` (one or several files linked into one library) for
    ``target``, compiled now if missing; ``None`` when there is no compiler or the build fails
    (warned once per reason). ``headers`` only enter the cache key."""
    sources = _as_sources(source)
    compiler = find_compiler()
    if compiler is None:
        _warn_once("no-compiler", "cpu_kernel_unavailable", reason="g++ not found on PATH")
        return None
    directory = cache_dir() if directory is None else directory
    path = library_path(sources, target, compiler, directory, headers)
    if path.exists():
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _warn_once(f"cache:{directory}", "cpu_kernel_unavailable", reason=repr(exc))
        return None
    with _folder_lock(directory):
        if path.exists():  # another process built it while this one waited
            return path
        return _build_locked(compiler, target, sources, directory, path)


@contextlib.contextmanager
def _folder_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` itself (no lock file to leave behind); where
    that is not possible (no ``fcntl``, a file system without locks) build unlocked: the atomic
    ``os.replace`` alone keeps concurrent builds correct, only duplicated."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        yield
    finally:
        os.close(fd)


def _build_locked(
    compiler: str, target: str, sources: tuple[Path, ...], directory: Path, path: Path
) -> Path | None:
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".so", dir=directory)
    except OSError as exc:
        _warn_once(f"cache:{directory}", "cpu_kernel_unavailable", reason=repr(exc))
        return None
    os.close(fd)
    tmp = Path(tmp_name)
    log.info("cpu_kernel_compile_started", note=BUILD_NOTE, target=target, path=str(path))
    start = time.perf_counter()
    try:
        failure = _compile_and_link(compiler, target, sources, tmp)
        if failure is not None:
            command, stderr = failure
            _warn_once(
                f"compile:{target}:{path.name}",
                "cpu_kernel_unavailable",
                reason="compile failed",
                target=target,
                command=" ".join(command),
                stderr=stderr[-2000:],
            )
            return None
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        _warn_once(f"compile:{target}:{path.name}", "cpu_kernel_unavailable", reason=repr(exc))
        return None
    finally:
        tmp.unlink(missing_ok=True)
    seconds = round(time.perf_counter() - start, 2)
    log.info("cpu_kernel_compiled", target=target, path=str(path), seconds=seconds)
    return path


def _compile_and_link(
    compiler: str, target: str, sources: tuple[Path, ...], out: Path
) -> tuple[list[str], str] | None:
    """Build ``sources`` into the library ``out``: one source directly, several as objects
    compiled side by side (one g++ each, so the units build in parallel) and then linked.
    Returns the failing command and its stderr, or ``None``."""
    flags = compile_flags(target)
    if len(sources) == 1:
        command = [compiler, *flags, str(sources[0]), "-o", str(out)]
        done = _run(command)
        return None if done.returncode == 0 else (command, done.stderr)
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=out.parent) as folder:
        objects = [Path(folder) / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
        commands = [
            [compiler, *flags, "-c", str(src), "-o", str(obj)]
            for src, obj in zip(sources, objects, strict=True)
        ]
        with ThreadPoolExecutor(len(commands)) as pool:
            results = list(pool.map(_run, commands))
        for command, done in zip(commands, results, strict=True):
            if done.returncode != 0:
                return command, done.stderr
        command = [compiler, *flags, *map(str, objects), "-o", str(out)]
        done = _run(command)
        return None if done.returncode == 0 else (command, done.stderr)


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)


def build_id(target: str | None = None) -> str:
    """The native library's build for ``target`` (default: ``select_target()``) as
    ``"<target> <hash>"``: the hash of every source, header and flag and the compiler's version
    that names the cached library (built or not); or why there is none."""
    target = select_target() if target is None else target
    compiler = find_compiler()
    if compiler is None:
        return f"{target}: no g++ on PATH"
    path = library_path(SOURCES, target, compiler, Path(), HEADERS)
    return f"{target} {path.stem.rsplit('-', 1)[-1]}"


def load_library(target: str | None = None) -> ctypes.CDLL | None:
    """The kernel library for ``target`` (default: ``select_target()``), built on first
    use and kept for the process; ``None`` when unavailable (callers fall back to torch)."""
    target = select_target() if target is None else target
    _check_target(target)
    with _lock:
        if target not in _loaded:
            _loaded[target] = _load(target)
        return _loaded[target]


def _load(target: str) -> ctypes.CDLL | None:
    if target not in supported_targets():
        _warn_once(f"target:{target}", "cpu_kernel_unavailable", reason="CPU lacks the target")
        return None
    path = build(SOURCES, target, headers=HEADERS)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _warn_once(f"load:{path}", "cpu_kernel_unavailable", reason=repr(exc), path=str(path))
        return None
    _declare(lib)
    assert lib.asyncpaged_vec_bytes() == VEC_BYTES[target], f"{path} is not a {target} build"
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types of the entry points (see the ``extern "C"`` blocks in csrc/)."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.asyncpaged_vec_bytes.argtypes = []
    lib.asyncpaged_vec_bytes.restype = i32
    lib.asyncpaged_decode_plan_create.restype = ptr
    lib.asyncpaged_decode_plan_create.argtypes = [
        i64, i32,  # num_query_rows, kv_dtype
        i64, i64, i64, i64,  # num_blocks, num_kv_heads, head_dim, block_size
        ptr, i64, i64, i64,  # block_tables, stride, max_blocks_per_seq, num_table_rows
        ptr, ptr, ptr, i64,  # context_lens, seq_indices, query_rows, num_items
        i64, ctypes.c_float, i64,  # num_heads, scale, sliding_window
        ctypes.c_float, ctypes.POINTER(i32),  # softcap, status (out)
    ]  # fmt: skip
    lib.asyncpaged_decode_plan_run.restype = i32
    lib.asyncpaged_decode_plan_run.argtypes = [
        ptr, ptr, i64, ptr, i64,  # plan, out, out_row_stride, query, query_row_stride
        ptr, ptr, ptr, ptr, i32,  # key_cache, value_cache, key_scale, value_scale, threads
    ]  # fmt: skip
    lib.asyncpaged_decode_plan_free.restype = None
    lib.asyncpaged_decode_plan_free.argtypes = [ptr]
    lib.asyncpaged_paged_prefill.restype = i32
    lib.asyncpaged_paged_prefill.argtypes = [
        ptr, i64,  # out, out_row_stride
        ptr, i64, i64,  # query, query_row_stride, num_query_rows
        ptr, ptr, ptr, ptr, i32,  # key_cache, value_cache, key_scale, value_scale, kv_dtype
        i64, i64, i64, i64,  # num_blocks, num_kv_heads, head_dim, block_size
        ptr, i64, i64, i64,  # block_tables, stride, max_blocks_per_seq, num_table_rows
        ptr, ptr, ptr, i64,  # context_lens, query_start_loc, seq_indices, num_seqs
        i64, ctypes.c_float, i64,  # num_heads, scale, sliding_window
        ctypes.c_float, i64, i64, i32,  # softcap, query_tile, key_tile_blocks, num_threads
    ]  # fmt: skip
    lib.asyncpaged_cache_write.restype = i32
    lib.asyncpaged_cache_write.argtypes = [
        ptr, ptr, ptr, ptr, i32,  # key_cache, value_cache, key_scale, value_scale, cache_dtype
        i64, i64, i64, i64,  # num_blocks, num_kv_heads, head_dim, block_size
        ptr, i64, ptr, i64, i32,  # key, key_row_stride, value, value_row_stride, src_dtype
        ptr, i64, i32,  # slot_mapping, num_tokens, num_threads
    ]  # fmt: skip


def _as_sources(source: Path | Sequence[Path]) -> tuple[Path, ...]:
    sources = (source,) if isinstance(source, Path) else tuple(source)
    if not sources:
        raise ValueError("build needs at least one source file.")
    return sources


def _compiler_version(compiler: str) -> str:
    if compiler not in _compiler_versions:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=False, timeout=60
        )
        _compiler_versions[compiler] = done.stdout.strip() or done.stderr.strip()
    return _compiler_versions[compiler]


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"CPU target must be one of {TARGETS}, got {target!r}.")


def _warn_once(key: str, event: str, **fields: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(event, **fields)
