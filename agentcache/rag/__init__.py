"""RAG: load documents, chunk them with stable ids, retrieve (BM25 or embeddings), cache results.

``create_retriever(name)`` picks a retriever from the registry; the embedding retriever is
imported lazily (optional extra ``embed``).
"""

from __future__ import annotations

import importlib
from typing import Any

from agentcache.exceptions import ConfigError
from agentcache.rag.base import BaseRetriever, Hit
from agentcache.rag.bm25 import BM25Retriever
from agentcache.rag.chunking import Chunk, TextSource, chunk_sources, chunk_text
from agentcache.rag.loader import load_folder, to_sources
from agentcache.rag.pipeline import DocumentIndex, format_chunks
from agentcache.rag.stdlib import stdlib_sources

__all__ = [
    "RETRIEVERS",
    "BM25Retriever",
    "BaseRetriever",
    "Chunk",
    "DocumentIndex",
    "Hit",
    "TextSource",
    "chunk_sources",
    "chunk_text",
    "create_retriever",
    "format_chunks",
    "load_folder",
    "stdlib_sources",
    "to_sources",
]

RETRIEVERS: dict[str, str] = {
    "bm25": "agentcache.rag.bm25:BM25Retriever",
    "embed": "agentcache.rag.embed:EmbeddingRetriever",
}
"""Registry: retriever name -> ``module:class``."""


def create_retriever(name: str = "bm25", **options: Any) -> BaseRetriever:
    """Create a retriever by registry name.

    Raises:
        ConfigError: Unknown name (the message lists the valid ones).
        BackendUnavailableError: ``embed`` without the optional extra installed.
    """
    if name not in RETRIEVERS:
        raise ConfigError(
            f"unknown retriever {name!r}; valid names: {', '.join(sorted(RETRIEVERS))}"
        )
    module_name, _, class_name = RETRIEVERS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**options)  # type: ignore[no-any-return]
