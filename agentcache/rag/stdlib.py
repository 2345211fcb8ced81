"""A real corpus nobody here wrote: docstrings of the installed Python standard library.

Walks the stdlib folder with ``ast`` (no imports, no execution), in sorted path order, skipping
tests, demos and GUI packages, and stops at fixed bounds so the corpus size is predictable.
Knows nothing about chunking or retrieval.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from agentcache.rag.chunking import TextSource

__all__ = ["stdlib_root", "stdlib_sources"]

_SKIP_PARTS = frozenset(
    {
        "site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo",
        "lib2to3", "ensurepip", "pydoc_data", "__pycache__", "venv", "encodings", "msilib",
    }
)  # fmt: skip

_Definition = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def stdlib_root() -> Path:
    """Folder of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(
    *,
    root: Path | None = None,
    max_files: int = 250,
    max_chars: int = 1_500_000,
    min_doc_chars: int = 40,
    progress: Callable[[int, int], None] | None = None,
) -> list[TextSource]:
    """Docstrings of stdlib modules, classes and functions, one ``TextSource`` each.

    Modules are read in sorted path order (top-level modules and packages alike); private
    modules (``_name.py``) and private definitions are skipped. Each text starts with the dotted
    name so retrieval can match on it.

    Args:
        root: Stdlib folder (default: ``stdlib_root()``).
        max_files: Read at most this many ``.py`` files.
        max_chars: Stop once the docstrings collected reach this many characters.
        min_doc_chars: Ignore shorter docstrings.
        progress: Called as ``progress(files_done, files_total)`` after each file.

    Returns:
        Sources named ``module:qualname`` (``module`` alone for module docstrings).
    """
    files = _module_files(root or stdlib_root())[:max_files]
    sources: list[TextSource] = []
    total_chars = 0
    for done, (module, path) in enumerate(files, start=1):
        for source in _docstrings(module, path, min_doc_chars):
            sources.append(source)
            total_chars += len(source.text)
        if progress is not None:
            progress(done, len(files))
        if total_chars >= max_chars:
            break
    return sources


def _module_files(root: Path) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIP_PARTS or part.startswith("config-") for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not parts or any(part.startswith("_") or "-" in part for part in parts):
            continue
        found.append((".".join(parts), path))
    return sorted(found)


def _docstrings(module: str, path: Path, min_chars: int) -> Iterator[TextSource]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return
    for qualname, node in _definitions(tree, ""):
        doc = ast.get_docstring(node, clean=True)
        if not doc or len(doc) < min_chars:
            continue
        name = f"{module}.{qualname}" if qualname else module
        source = f"{module}:{qualname}" if qualname else module
        yield TextSource(source, f"{name}\n\n{doc}")


def _definitions(node: _Definition, prefix: str) -> Iterator[tuple[str, _Definition]]:
    yield prefix, node
    for child in node.body:
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if child.name.startswith("_"):
                continue
            qualname = f"{prefix}.{child.name}" if prefix else child.name
            if isinstance(child, ast.ClassDef):
                yield from _definitions(child, qualname)
            else:
                yield qualname, child
