"""The kernels ship as ``asyncpaged.kernels`` (never a top-level ``kernels``) in editable and wheel
installs: the Python under src/asyncpaged/kernels, the C++ sources of the top-level kernels/ folder
as ``asyncpaged/kernels/csrc`` in a wheel. The wheel is built from a copy of the sources with
``--no-build-isolation`` (no network) and installed into a scratch venv that borrows this one's
dependencies (a ``.pth`` line); about 10-20 s."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PROBE = (
    "import importlib.util, asyncpaged.kernels as k; "
    "from asyncpaged.kernels import paged_attention, reshape_and_cache, copy_blocks; "
    "from asyncpaged.kernels import cpu_build; "
    "assert all(p.is_file() for p in cpu_build.SOURCES + cpu_build.HEADERS), cpu_build.SOURCES; "
    "spec = importlib.util.find_spec('kernels'); "
    "print(k.__file__); print(spec.origin if spec else None)"
)


def _probe(cwd: Path, python: Path | None = None) -> tuple[Path, str]:
    """``python -c`` from ``cwd`` (first on its ``sys.path``): where ``asyncpaged.kernels`` and a
    top-level ``kernels`` come from."""
    drop = ("PYTHONPATH", "TRITON_INTERPRET", "PYTHONSAFEPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    done = subprocess.run(
        [str(python or sys.executable), "-c", _PROBE],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    kernels_file, top_level = done.stdout.split()
    return Path(kernels_file), top_level


def _not_ours(top_level: str, *ours: Path) -> bool:
    """A top-level ``kernels`` is importable only from somewhere else (Hugging Face's
    ``kernels`` distribution, which transformers >= 5.25 requires), never from ``ours``."""
    return top_level == "None" or not any(Path(top_level).is_relative_to(d) for d in ours)


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_editable_install_imports_asyncpaged_kernels(tmp_path: Path, where: str) -> None:
    """From the repository root too, where the README's commands run: ``import kernels`` there
    is Hugging Face's, not our folder."""
    kernels_file, top_level = _probe(ROOT if where == "root" else tmp_path)
    assert kernels_file == ROOT / "src" / "asyncpaged" / "kernels" / "__init__.py"
    assert _not_ours(top_level, ROOT / "kernels", ROOT / "src"), (
        f"our kernels/ is importable as a top-level `kernels` package: {top_level}"
    )


def _packages_in_src() -> set[str]:
    src = ROOT / "src"
    return {
        ".".join(p.parent.relative_to(src).parts) for p in src.glob("asyncpaged/**/__init__.py")
    }


def test_wheel_ships_asyncpaged_kernels_and_every_package(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    (wheel,) = tmp_path.glob("asyncpaged-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "asyncpaged/kernels/__init__.py" in names
    assert "asyncpaged/kernels/paged_attention.py" in names
    for source in ("paged_decode.cpp", "paged_prefill.cpp", "cache_write.cpp", "cpu_vec.h"):
        assert f"asyncpaged/kernels/csrc/{source}" in names  # the CPU kernels build from them
    assert not [n for n in names if n.startswith("kernels/")], "top-level kernels/ in the wheel"
    shipped = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("__init__.py")}
    missing = _packages_in_src() - shipped
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)  # fmt: skip
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip())  # fmt: skip
    # torch and the rest from this environment; a plain path entry, so the editable install's
    # own .pth finder there is not run and asyncpaged comes from the wheel
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [*pip, "--python", str(python), "install", "--no-deps", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=120)
    kernels_file, top_level = _probe(tmp_path, python)  # its csrc/ builds the CPU kernels
    assert kernels_file == site / "asyncpaged" / "kernels" / "__init__.py"
    assert _not_ours(top_level, site, ROOT / "kernels"), (
        f"the wheel installs a top-level `kernels` package: {top_level}"
    )
