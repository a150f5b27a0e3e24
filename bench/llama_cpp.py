"""llama.cpp built from source, the peer of ``asyncpaged bench quantized``.

llama.cpp is not a dependency: its source comes from llama-cpp-python's sdist (which vendors it at
``vendor/llama.cpp``), downloaded from the package registry, and its command-line tools are built
with CMake into a folder of their own::

    .venv/bin/python bench/llama_cpp.py build /tmp/llama.cpp [--version 0.3.36] [--jobs 2]
    .venv/bin/asyncpaged bench quantized --llama-cpp /tmp/llama.cpp/build ...

The build is CPU only (``GGML_NATIVE=ON``: the build machine's own instruction set, as the
engine's native kernels are), in Release mode, with only the tools the benchmark runs:
``llama-bench`` (prefill ``pp`` and decode ``tg``), ``llama-batched-bench`` (parallel sequences)
and ``llama-quantize`` (the K-quant mixes such as ``Q4_K_M`` that the ``gguf`` package cannot
write). On two cores the build takes several minutes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")


def download(folder: Path, version: str) -> Path:
    """llama-cpp-python's sdist into ``folder``, unpacked; the vendored llama.cpp's path."""
    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama_cpp_python=={version}",
                "-d",
                str(folder),
            ],
            check=True,
        )
    source = folder / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not source.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(folder, filter="data")
    return source


def build(folder: Path, version: str, jobs: int) -> Path:
    """Configure and build the tools; the build folder (``bin/`` holds them)."""
    source = download(folder, version)
    out = folder / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(out),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
        ],
        check=True,
    )
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *TOOLS], check=True)
    for tool in TOOLS:
        if not (out / "bin" / tool).exists():
            raise SystemExit(f"the build made no {out / 'bin' / tool}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    b = modes.add_parser("build", help="download llama-cpp-python's sdist and build the tools")
    b.add_argument("folder")
    b.add_argument("--version", default="0.3.36", help="llama-cpp-python's release")
    b.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    out = build(Path(args.folder), args.version, args.jobs)
    print(out)


if __name__ == "__main__":
    main()
