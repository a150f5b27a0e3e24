"""No function in ``asyncpaged`` reaches into another object's private state: an
attribute ``x._name`` read or written where ``x`` is one of the function's parameters other than
``self``/``cls`` (such a function is a method of ``x``'s class, or that state is a class of its
own that the owner holds). Dunder names and the named-tuple API (``_replace``, ``_fields``,
``_asdict``, ``_make``) are public and allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "asyncpaged"

PUBLIC_UNDERSCORED = frozenset({"_replace", "_fields", "_asdict", "_make", "_field_defaults"})

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def _parameters(node: FunctionNode) -> set[str]:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return set(names) - {"self", "cls"}


def _is_private(attr: str) -> bool:
    return (
        attr.startswith("_")
        and not (attr.startswith("__") and attr.endswith("__"))
        and attr not in PUBLIC_UNDERSCORED
    )


class _Finder(ast.NodeVisitor):
    """Collects ``(qualified function name, parameter, attribute)`` for each reach. A nested
    function sees its enclosing functions' parameters too (a closure reaching through one of
    them reaches as much), unless it rebinds the name as a parameter of its own."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.params: list[set[str]] = []
        self.found: list[tuple[str, str, str]] = []

    def _function(self, node: FunctionNode, name: str) -> None:
        own = _parameters(node)
        inherited = self.params[-1] if self.params else set()
        shadowed = {a.arg for a in (*node.args.posonlyargs, *node.args.args)} & {"self", "cls"}
        self.scope.append(name)
        self.params.append((inherited - shadowed) | own)
        self.generic_visit(node)
        self.params.pop()
        self.scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        saved, self.params = self.params, []  # a class body starts a fresh scope
        self.generic_visit(node)
        self.params = saved
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._function(node, node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node, "<lambda>")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        value = node.value
        if (
            self.params
            and isinstance(value, ast.Name)
            and value.id in self.params[-1]
            and _is_private(node.attr)
        ):
            self.found.append((".".join(self.scope), value.id, node.attr))
        self.generic_visit(node)


def private_reaches(path: Path) -> list[tuple[str, str, str]]:
    """``(function, parameter, attribute)`` for every private reach in ``path``."""
    finder = _Finder()
    finder.visit(ast.parse(path.read_text(), str(path)))
    return finder.found


def reaches_under(root: Path) -> dict[tuple[str, str], list[str]]:
    """(file, function) -> the ``parameter._attribute`` it reaches, for every ``.py`` file."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for function, param, attr in private_reaches(path):
            key = (path.relative_to(root).as_posix(), function)
            found.setdefault(key, []).append(f"{param}.{attr}")
    return found


def test_no_private_reaches() -> None:
    found = reaches_under(PACKAGE)
    assert not found, (
        "functions reaching into a parameter's private state (make them methods):\n"
        + ("\n".join(f"{f}: {fn}: {', '.join(a)}" for (f, fn), a in sorted(found.items())))
    )


def test_the_check_finds_a_planted_reach(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(
        "class Actor:\n"
        "    def method(self, other):\n"
        "        self._mine = other._theirs\n"
        "        return self._mine, other.public, other._replace(a=1), other.__class__\n"
        "\n"
        "def finish(actor, out):\n"
        "    actor._pending.append(out)\n"
        "\n"
        "async def outer(actor):\n"
        "    def inner():\n"
        "        return actor._log\n"
        "    return inner\n"
        "\n"
        "def local_only():\n"
        "    x = object()\n"
        "    return x._private\n"
    )
    assert reaches_under(tmp_path) == {
        ("planted.py", "Actor.method"): ["other._theirs"],
        ("planted.py", "finish"): ["actor._pending"],
        ("planted.py", "outer.inner"): ["actor._log"],
    }
