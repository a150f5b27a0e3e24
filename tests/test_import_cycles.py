"""No import cycles inside asyncpaged: every ``import`` and ``from ... import`` of every module
counts, at module level, inside functions and under ``TYPE_CHECKING`` alike (a cycle closed by a
type-only or a deferred import is still two modules that cannot be read one before the other).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "asyncpaged"


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str], root: Path = SRC) -> set[str]:
    """The modules of ``modules`` that ``path`` imports (a ``from pkg import name`` counts as
    ``pkg.name`` where that is a module, else as ``pkg``)."""
    name = module_name(path, root)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    edges = set()
    for imported in found:
        target = imported
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph(root: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    paths = sorted((root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    return {module_name(p, root): imports_of(p, modules, root) for p in paths}


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _show(groups: Iterable[frozenset[str]]) -> str:
    return "\n".join(sorted(", ".join(sorted(g)) for g in groups))


def test_no_import_cycles() -> None:
    import sys

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    found = cycles(import_graph())
    assert not found, f"import cycles (type-only and deferred imports count):\n{_show(found)}"


def test_the_check_finds_a_type_only_cycle(tmp_path: Path) -> None:
    """A cycle closed only under ``TYPE_CHECKING`` or inside a function is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\nB = 1\n"
    )
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    (pkg / "d.py").write_text("from .a import B\n")
    assert cycles(import_graph(tmp_path, "pkg")) == {frozenset({"pkg.a", "pkg.b", "pkg.c"})}
