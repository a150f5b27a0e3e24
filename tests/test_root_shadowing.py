"""Nothing in the repository root shadows an installed package or a standard-library module.

The README's commands run from the root, and ``python -m`` / ``python -c`` put the working
directory first on ``sys.path``: a root folder that Python can import (a regular package, or a
folder holding Python modules, which imports as a namespace package) under a name that an
installed distribution provides would replace that distribution for every import from there.
That is how the top-level ``kernels/`` folder once hid Hugging Face's ``kernels`` package, which
transformers imports when a model loads. ``kernels/`` holds C++ sources only; the kernels' Python
is ``asyncpaged.kernels`` under src/.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def importable_names(root: Path) -> set[str]:
    """The top-level import names that entries of ``root`` provide from a working directory
    of ``root``: ``name.py`` modules, folders with ``__init__.py``, and folders holding Python
    modules anywhere below (namespace packages)."""
    names: set[str] = set()
    for entry in root.iterdir():
        if entry.is_file() and entry.suffix == ".py" and entry.stem.isidentifier():
            names.add(entry.stem)
        elif (
            entry.is_dir()
            and entry.name.isidentifier()
            and ((entry / "__init__.py").is_file() or any(p.is_file() for p in entry.rglob("*.py")))
        ):
            names.add(entry.name)
    return names


def installed_names() -> dict[str, list[str]]:
    """Top-level import names of the installed distributions and the standard library, with
    who provides them."""
    provided = {
        name: list(dists) for name, dists in importlib.metadata.packages_distributions().items()
    }
    for name in sys.stdlib_module_names:
        provided.setdefault(name, []).append("the standard library")
    return provided


def clashes(root: Path, provided: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: provided[name] for name in sorted(importable_names(root) & provided.keys())}


def test_the_root_shadows_nothing_installed() -> None:
    provided = installed_names()
    assert "kernels" in provided, "Hugging Face's kernels (transformers >= 5.25 needs it)"
    found = clashes(ROOT, provided)
    assert not found, f"root folders that shadow installed packages when run from the root: {found}"


def test_a_root_package_named_kernels_is_caught(tmp_path: Path) -> None:
    """The check fails on a root folder importable as ``kernels``: a regular package, or a
    namespace one holding modules; C++ sources alone (today's ``kernels/``) import nothing."""
    provided = installed_names()
    (tmp_path / "kernels" / "csrc").mkdir(parents=True)
    (tmp_path / "kernels" / "csrc" / "paged_decode.cpp").write_text("")
    (tmp_path / "kernels" / "README.md").write_text("")
    assert clashes(tmp_path, provided) == {}
    (tmp_path / "kernels" / "triton").mkdir()
    (tmp_path / "kernels" / "triton" / "cache_ops.py").write_text("")
    assert clashes(tmp_path, provided) == {"kernels": provided["kernels"]}
    (tmp_path / "kernels" / "__init__.py").write_text("")
    assert clashes(tmp_path, provided) == {"kernels": provided["kernels"]}
    (tmp_path / "json.py").write_text("")
    assert set(clashes(tmp_path, provided)) == {"json", "kernels"}
