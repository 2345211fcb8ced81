"""Print import cycles and upward imports between our modules (every import, typing-only included).

Usage: ``python scripts/import_graph.py`` (exit 1 when a cycle or a layer violation exists).
Layers, lowest first: ``runtime.cache`` < ``runtime`` (engine) < ``runtime.serve`` <
``runtime.bench``;
``runtime`` never imports ``agentcache``. Inside the engine floor, ``RULES`` keeps folders apart:
``runtime.model`` never imports requests, the scheduler or the cache; ``runtime.sampling`` never
sees the batch or the tree. Also run as a test (tests/test_layering.py).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agentcache", "runtime")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every module of ours that ``path`` imports anywhere (top level, functions, TYPE_CHECKING)."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    this = module_name(path).split(".")
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = this if is_package else this[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module_name(path):
                out.add(name)
    return out


def layer(name: str) -> int:
    """Lower number = lower layer; a module may import only its own layer or lower ones."""
    if name.startswith("runtime.cache"):
        return 0
    if name.startswith("runtime.serve"):
        return 2
    if name.startswith("runtime.bench"):
        return 3
    if name.startswith("runtime"):
        return 1
    return 4  # agentcache (the SDK) sits on top


RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("runtime.model", ("runtime.request", "runtime.scheduler", "runtime.cache", "runtime.chunks")),
    (
        "runtime.sampling",
        (
            "runtime.cache",
            "runtime.scheduler",
            "runtime.model",
            "runtime.request",
            "runtime.chunks",
        ),
    ),
    ("runtime.chunks.spans", ("runtime.model", "runtime.sampling", "runtime.scheduler")),
    ("runtime.config", ("runtime.model", "runtime.scheduler.loop", "runtime.request")),
)
"""(folder, what no module in it may import): the engine floor's inner walls."""


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that break one of ``RULES``."""
    return sorted(
        (m, d)
        for m, deps in edges.items()
        for folder, banned in RULES
        if _within(m, folder)
        for d in deps
        if any(_within(d, b) for b in banned)
    )


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges = {name: imports_of(path, known) for name, path in mods.items()}
    # NOTE: a package's __init__ importing its own submodules is a re-export, not a dependency.
    return {m: {d for d in deps if not m or not d.startswith(m + ".")} for m, deps in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)  # NOTE: tests load this script in-process
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that point to a higher layer (runtime -> agentcache included)."""
    return sorted(
        (m, d)
        for m, deps in edges.items()
        for d in deps
        if m.startswith("runtime") and layer(d) > layer(m) and m != "runtime"
    )


def main() -> int:
    edges = graph()
    bad_cycles, bad_up, bad_in = cycles(edges), upward(edges), forbidden(edges)
    for comp in bad_cycles:
        print("cycle:", " <-> ".join(comp))
    for m, d in bad_up:
        print(f"upward: {m} imports {d}")
    for m, d in bad_in:
        print(f"forbidden: {m} imports {d}")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, "
          f"{len(bad_cycles)} cycles, {len(bad_up)} upward imports, "
          f"{len(bad_in)} forbidden imports")  # fmt: skip
    return 1 if bad_cycles or bad_up or bad_in else 0


if __name__ == "__main__":
    raise SystemExit(main())
