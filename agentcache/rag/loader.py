"""Load text sources from a folder (.md/.txt/.py) or from any iterable of documents.

Files are read in sorted relative-path order so the corpus, and therefore the chunk ids and the
index fingerprint, are the same on every run. Knows nothing about chunking or retrieval.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from agentcache.exceptions import ConfigError
from agentcache.rag.chunking import TextSource

__all__ = ["DEFAULT_SUFFIXES", "load_folder", "to_sources"]

DEFAULT_SUFFIXES: tuple[str, ...] = (".md", ".txt", ".py")
_SKIP_DIRS = frozenset({".git", ".venv", "venv", "__pycache__", "node_modules", ".tox"})


def load_folder(
    path: str | Path,
    *,
    suffixes: Iterable[str] = DEFAULT_SUFFIXES,
    max_file_bytes: int = 1_000_000,
    max_files: int | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> list[TextSource]:
    """Read every matching file under ``path``, in sorted relative-path order.

    Hidden folders and virtual environments are skipped; files larger than ``max_file_bytes``,
    files that are not valid UTF-8 or cannot be read, and empty (whitespace-only) files are
    skipped too, each reported to ``on_skip``.

    Args:
        path: Folder (or single file) to read.
        suffixes: File name endings to include.
        max_file_bytes: Larger files are skipped.
        max_files: Stop after this many files (``None``: no limit).
        on_skip: Called with (relative name, reason) for every skipped matching file.

    Returns:
        One ``TextSource`` per file; ``source`` is the path relative to ``path`` (POSIX form).

    Raises:
        ConfigError: ``path`` does not exist.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"document folder {str(root)!r} does not exist")
    wanted = tuple(suffixes)
    files = [root] if root.is_file() else sorted(_walk(root, wanted), key=lambda p: p.as_posix())
    sources: list[TextSource] = []
    for file in files:
        if max_files is not None and len(sources) >= max_files:
            break
        name = file.name if file == root else file.relative_to(root).as_posix()
        text, reason = _read(file, max_file_bytes)
        if text is not None:
            sources.append(TextSource(name, text))
        elif on_skip is not None:
            on_skip(name, reason)
    return sources


def _read(file: Path, max_file_bytes: int) -> tuple[str | None, str]:
    """The file's text, or None and why it is skipped."""
    try:
        if file.stat().st_size > max_file_bytes:
            return None, f"larger than {max_file_bytes} bytes"
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None, "not valid UTF-8"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    if not text.strip():
        return None, "empty"
    return text, ""


def _walk(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    found: list[Path] = []
    for path in root.rglob("*"):
        parts = path.relative_to(root).parts
        if any(part in _SKIP_DIRS or part.startswith(".") for part in parts):
            continue
        if path.is_file() and path.name.endswith(suffixes):
            found.append(path)
    return found


def to_sources(documents: Iterable[Any]) -> list[TextSource]:
    """Turn an iterable of documents into ``TextSource`` records, keeping its order.

    Accepts ``TextSource``, ``(source, text)`` pairs, plain strings (named ``doc-<n>``) and any
    object with ``text`` and ``id`` or ``source`` attributes (e.g. ``agentcache.prompt.Document``).

    Raises:
        TypeError: An item has none of those shapes.
    """
    sources: list[TextSource] = []
    for index, item in enumerate(documents):
        if isinstance(item, TextSource):
            sources.append(item)
        elif isinstance(item, str):
            sources.append(TextSource(f"doc-{index}", item))
        elif isinstance(item, tuple) and len(item) == 2:
            sources.append(TextSource(str(item[0]), str(item[1])))
        elif hasattr(item, "text"):
            name = getattr(item, "source", None) or getattr(item, "id", None) or f"doc-{index}"
            sources.append(TextSource(str(name), str(item.text)))
        else:
            raise TypeError(f"cannot read a document from {type(item).__name__!r} at {index}")
    return sources
