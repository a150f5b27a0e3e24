"""kernels/ ships as ``asyncpaged.kernels`` (never a top-level ``kernels``) in editable and wheel
installs. The wheel is built from a copy of the sources with ``--no-build-isolation`` (no network)
and installed with ``pip install --target``; about 10-20 s."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_PROBE = (
    "import importlib.util, asyncpaged.kernels as k; "
    "from asyncpaged.kernels import paged_attention, reshape_and_cache, copy_blocks; "
    "spec = importlib.util.find_spec('kernels'); "
    "print(k.__file__); print(spec.origin if spec else None)"
)


def _probe(env_path: str | None, cwd: Path) -> tuple[Path, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
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


def test_editable_install_maps_kernels_into_the_package(tmp_path: Path) -> None:
    kernels_file, top_level = _probe(None, tmp_path)
    assert kernels_file == ROOT / "kernels" / "__init__.py"
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
    site = tmp_path / "site"
    install = [*pip, "install", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=120)
    kernels_file, top_level = _probe(str(site), tmp_path)
    assert kernels_file == site / "asyncpaged" / "kernels" / "__init__.py"
    assert _not_ours(top_level, site, ROOT / "kernels"), (
        f"the wheel installs a top-level `kernels` package: {top_level}"
    )
