"""What each native CPU build really contains: vectors of its target's width, with
software prefetch, and no instruction of a wider ISA (the avx2 build must run on a CPU
without AVX-512, the baseline build on any x86-64). Read from the compiled library's
disassembly, so it holds on whatever CPU runs the tests: compiling a target does not need
the CPU to run it."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache

import pytest

from asyncpaged.kernels import cpu_build

pytestmark = pytest.mark.skipif(
    not cpu_build.is_x86() or cpu_build.find_compiler() is None or shutil.which("objdump") is None,
    reason="needs an x86 CPU, g++ and objdump (binutils)",
)


@cache
def _disassembly(target: str) -> str:
    path = cpu_build.build(cpu_build.SOURCES, target, headers=cpu_build.HEADERS)
    assert path is not None, f"the {target} build failed (see the log)"
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)],
                         check=True, capture_output=True, text=True)  # fmt: skip
    return out.stdout


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text, flags=re.MULTILINE))


# packed single-precision FMAs by register width: xmm 4 lanes, ymm 8, zmm 16
FMA = r"\bvfn?m(?:add|sub)[0-9]+ps\s+.*%{reg}"


def test_the_avx512_build_is_16_wide_and_prefetches() -> None:
    text = _disassembly("avx512")
    assert _count(FMA.format(reg="zmm"), text) > 500
    assert _count(r"\bprefetch", text) > 50


def test_the_avx2_build_is_8_wide_prefetches_and_has_no_avx512() -> None:
    text = _disassembly("avx2")
    assert _count(FMA.format(reg="ymm"), text) > 500
    assert _count(FMA.format(reg="xmm"), text) < 10  # no 4-wide main loops
    assert _count(r"\bprefetch", text) > 50
    assert _count(r"%zmm|%k[0-7]\b", text) == 0, "AVX-512 in the AVX2 build"


def test_the_baseline_build_is_4_wide_sse_only() -> None:
    text = _disassembly("baseline")
    assert _count(r"\bmulps\s", text) > 500  # packed SSE multiplies
    assert _count(r"\bprefetch", text) > 50
    assert _count(r"%[yz]mm|%k[0-7]\b|\bvfn?m(?:add|sub)", text) == 0, "AVX in the baseline build"
