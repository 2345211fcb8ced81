"""The RAG pipeline: a chunked corpus, a retriever, a retrieval cache and cache-stable context.

``DocumentIndex`` retrieves through ``RetrievalCache`` (keyed by retriever, index fingerprint,
query and k) and returns chunks sorted by chunk id, not by score, so the same set of chunks always
renders to the same prompt bytes. Knows nothing about models or agents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentcache.cache.keys import index_fingerprint
from agentcache.cache.tool import DEPENDS_ON_ATTR
from agentcache.rag.base import BaseRetriever
from agentcache.rag.bm25 import BM25Retriever
from agentcache.rag.chunking import Chunk, TextSource, chunk_sources
from agentcache.rag.loader import load_folder, to_sources

if TYPE_CHECKING:
    from agentcache.cache import RetrievalCache

__all__ = ["DocumentIndex", "format_chunks"]


def format_chunks(chunks: Sequence[Chunk]) -> str:
    """Render chunks as the text of a tool result or context block, in the given order."""
    if not chunks:
        return "No matching documents."
    return "\n\n".join(f"[{c.id}] ({c.source})\n{c.text}" for c in chunks)


class DocumentIndex:
    """A chunked corpus with a retriever and an optional retrieval-result cache."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        *,
        retriever: BaseRetriever | None = None,
        cache: RetrievalCache | None = None,
    ) -> None:
        """Index ``chunks``.

        Args:
            chunks: The corpus (see ``chunk_sources``); must not be empty.
            retriever: Scoring method (default ``BM25Retriever()``).
            cache: Retrieval-result cache; ``None`` computes every query.

        Raises:
            EmptyCorpusError: ``chunks`` is empty (a ValueError).
        """
        self.chunks = list(chunks)
        self.retriever = retriever or BM25Retriever()
        self.cache = cache
        self._reindex()

    def _reindex(self) -> None:
        self.retriever.index(self.chunks)
        self._by_id = {chunk.id: chunk for chunk in self.chunks}
        self.fingerprint = _fingerprint(self.chunks, self.retriever)

    def add(self, chunks: Iterable[Chunk]) -> None:
        """Add ``chunks`` (ids not yet in the index) and re-index.

        The fingerprint changes with the corpus, so cached retrievals and ``search_tool`` results
        of the old corpus are never served again.

        Raises:
            ValueError: a chunk id is already in the index.
        """
        new = list(chunks)
        clash = sorted({c.id for c in new} & self._by_id.keys())
        if clash:
            raise ValueError(f"chunk ids already indexed: {clash[:5]}")
        self.chunks.extend(new)
        self._reindex()

    def add_sources(self, sources: Iterable[TextSource], *, max_chars: int = 800) -> None:
        """Chunk ``sources`` like ``from_sources`` and ``add`` them."""
        self.add(chunk_sources(sources, max_chars=max_chars))

    @classmethod
    def from_sources(
        cls, sources: Iterable[TextSource], *, max_chars: int = 800, **options: Any
    ) -> DocumentIndex:
        """Chunk ``sources`` (``max_chars`` per chunk) and index them; options as ``__init__``."""
        return cls(chunk_sources(sources, max_chars=max_chars), **options)

    @classmethod
    def from_folder(cls, path: str | Path, **options: Any) -> DocumentIndex:
        """Load .md/.txt/.py files under ``path`` (see ``load_folder``) and index them."""
        return cls.from_sources(load_folder(path), **options)

    @classmethod
    def from_documents(cls, documents: Iterable[Any], **options: Any) -> DocumentIndex:
        """Index any iterable of documents (see ``to_sources`` for accepted shapes)."""
        return cls.from_sources(to_sources(documents), **options)

    def retrieve(self, query: str, k: int = 4) -> list[Chunk]:
        """The best ``k`` chunks for ``query``, sorted by chunk id (stable prompt order).

        Goes through the retrieval cache when one is set: a repeated (retriever, index, query,
        k) is answered without scoring.

        Raises:
            ValueError: ``k`` < 1.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")

        def compute() -> list[str]:
            return [hit.chunk.id for hit in self.retriever.search(query, k)]

        if self.cache is None:
            ids = compute()
        else:
            ids = self.cache.get_or_compute(
                retriever_id=self.retriever.retriever_id,
                index_fingerprint=self.fingerprint,
                query=query,
                k=k,
                compute=compute,
            )
        return sorted((self._by_id[i] for i in ids if i in self._by_id), key=lambda c: c.id)

    def search_tool(self, *, k: int = 4) -> Callable[[str], str]:
        """A ``search_docs(query)`` tool function for an ``Agent`` (results via ``retrieve``).

        The function binds its state: a ``ToolCache`` that wraps it keys each call by the
        index's fingerprint at call time, the retriever and ``k`` as well as the query, so
        added documents are found at once (and after a restart) and tools with different ``k``
        never share entries.

        Raises:
            ValueError: ``k`` < 1.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")

        def search_docs(query: str) -> str:
            """Search the document collection and return the most relevant passages.

            Args:
                query: Keywords or a question describing what to look for.
            """
            return format_chunks(self.retrieve(query, k))

        def state() -> dict[str, Any]:
            return {"index": self.fingerprint, "k": k, "retriever": self.retriever.retriever_id}

        setattr(search_docs, DEPENDS_ON_ATTR, state)
        return search_docs


def _fingerprint(chunks: Sequence[Chunk], retriever: BaseRetriever) -> str:
    ordered = sorted(chunks, key=lambda c: c.id)
    return index_fingerprint(
        ((c.id, c.text) for c in ordered), retriever=retriever.retriever_id, **retriever.settings
    )
