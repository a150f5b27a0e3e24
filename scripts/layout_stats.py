"""The layout's numbers for a checkout: modules, import circles (type-only and deferred imports
count), the longest chain of imports, and the engine files one greedy request runs code in.

    .venv/bin/python scripts/layout_stats.py [SRC_DIR]   # default: this checkout's src/

The files one request crosses are traced (``sys.setprofile`` in every thread) over the second of
two identical greedy requests on the built-in model, so startup and first-call imports do not
count; the runner runs on a thread of the engine's process here (``executor_backend="thread"``
where the config has it)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_import_cycles import cycles, import_graph  # the CI test's own


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain, counted over the circles collapsed to one node each."""
    circles = cycles(graph)
    comp_of = {m: c for c in circles for m in c}
    for m in graph:
        comp_of.setdefault(m, frozenset({m}))
    comps = set(comp_of.values())
    memo: dict[frozenset[str], list[frozenset[str]]] = {}

    def longest(c: frozenset[str]) -> list[frozenset[str]]:
        if c not in memo:
            nexts = {comp_of[d] for m in c for d in graph[m]} - {c}
            best = max((longest(n) for n in nexts), key=len, default=[])
            memo[c] = [c, *best]
        return memo[c]

    chain = max((longest(c) for c in comps), key=len)
    return [min(c) if len(c) == 1 else "{" + ", ".join(sorted(c)) + "}" for c in chain]


def files_one_request_crosses(src: Path) -> list[str]:
    sys.path.insert(0, str(src))
    import anyio

    from asyncpaged import AsyncEngine, EngineConfig, SamplingParams, default_model

    package = str((src / "asyncpaged").resolve())
    seen: set[str] = set()
    tracing = threading.Event()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and tracing.is_set():
            name = frame.f_code.co_filename
            if name.startswith(package):
                seen.add(name[len(package) + 1 :])

    sys.setprofile(profile)  # before the engine's threads start: they inherit it
    threading.setprofile(profile)

    async def main() -> None:
        kwargs = {"model": str(default_model.path())}
        fields = getattr(EngineConfig, "__dataclass_fields__", {})
        if "executor_backend" in fields:
            kwargs["executor_backend"] = "thread"
        async with AsyncEngine(EngineConfig(**kwargs)) as engine:
            params = SamplingParams(max_tokens=8, temperature=0.0)
            await engine.generate("The paged cache", params)
            tracing.set()
            await engine.generate("The paged cache", params)
            tracing.clear()

    anyio.run(main)
    sys.setprofile(None)
    return sorted(seen)


def main() -> None:
    sys.setrecursionlimit(10_000)  # the recursive cycle search and chain walk
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src")
    graph = import_graph(src)
    circles = sorted(cycles(graph), key=len, reverse=True)
    chain = longest_chain(graph)
    print(f"modules: {len(graph)}")
    print(f"import circles: {len(circles)} ({', '.join(str(len(c)) for c in circles) or 'none'})")
    print(f"longest import chain: {len(chain)} modules: {' -> '.join(chain)}")
    crossed = files_one_request_crosses(src)
    print(f"files one greedy request crosses: {len(crossed)}")
    for f in crossed:
        print(f"  {f}")


if __name__ == "__main__":
    main()
