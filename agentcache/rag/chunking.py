"""Text sources and chunking into pieces with stable, content-derived ids.

A ``TextSource`` is one named text (a file, a docstring); ``chunk_sources`` splits texts on
paragraph boundaries into ``Chunk`` records whose id is a hash of (source, text), so the same
corpus always yields the same ids in the same order. Knows nothing about retrieval or prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from agentcache.canonical import normalize_text, stable_hash

__all__ = ["Chunk", "TextSource", "chunk_sources", "chunk_text"]

CHUNK_ID_HEX_LEN = 16
"""Hex digits kept from the SHA-256 chunk hash (64 bits: collisions need ~4e9 chunks)."""


class TextSource(NamedTuple):
    """One named text before chunking."""

    source: str
    """Where it came from (relative path, ``module:qualname``...)."""
    text: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a source text, the unit of retrieval."""

    id: str
    """Content-derived id: first 16 hex digits of ``stable_hash("chunk", source, text)``."""
    text: str
    """Normalized chunk text (``agentcache.canonical.normalize_text``)."""
    source: str
    """The ``TextSource.source`` it came from."""
    position: int
    """0-based index of the chunk within its source."""


def chunk_text(text: str, *, max_chars: int = 800) -> list[str]:
    """Split ``text`` into pieces of at most ``max_chars`` characters.

    Paragraphs (blank-line separated) are packed greedily; a paragraph longer than ``max_chars``
    is split on lines, and a line longer than that is cut hard. Deterministic.

    Raises:
        ValueError: ``max_chars`` < 50.
    """
    if max_chars < 50:
        raise ValueError(f"max_chars must be >= 50, got {max_chars!r}")
    pieces: list[str] = []
    current = ""
    for unit in _units(normalize_text(text), max_chars):
        candidate = f"{current}\n\n{unit}" if current else unit
        if len(candidate) <= max_chars:
            current = candidate
            continue
        if current:
            pieces.append(current)
        current = unit
    if current:
        pieces.append(current)
    return pieces


def _units(text: str, max_chars: int) -> Iterator[str]:
    for paragraph in text.split("\n\n"):
        paragraph = paragraph.strip("\n")
        if not paragraph.strip():
            continue
        if len(paragraph) <= max_chars:
            yield paragraph
            continue
        for line in paragraph.split("\n"):
            for start in range(0, max(len(line), 1), max_chars):
                piece = line[start : start + max_chars]
                if piece.strip():
                    yield piece


def chunk_sources(sources: Iterable[TextSource], *, max_chars: int = 800) -> list[Chunk]:
    """Chunk every source in order; duplicate chunks (same source and text) are kept once.

    Returns:
        Chunks in source order, then position order.
    """
    chunks: list[Chunk] = []
    seen: set[str] = set()
    for source in sources:
        for position, text in enumerate(chunk_text(source.text, max_chars=max_chars)):
            chunk_id = stable_hash("chunk", source.source, text)[:CHUNK_ID_HEX_LEN]
            if chunk_id in seen:
                continue
            seen.add(chunk_id)
            chunks.append(Chunk(id=chunk_id, text=text, source=source.source, position=position))
    return chunks
