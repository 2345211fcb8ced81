"""The retriever contract: index chunks once, then return the best chunks for a query.

Retrievers score; they never order results for the prompt (``rag.pipeline`` re-sorts hits by
chunk id so repeated contexts form identical prefixes) and never cache (the pipeline wraps them in
``RetrievalCache``). Knows nothing about prompts or models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from agentcache.rag.chunking import Chunk

__all__ = ["BaseRetriever", "Hit"]


class Hit(NamedTuple):
    """One retrieved chunk and its retriever-specific score (higher is better)."""

    chunk: Chunk
    score: float


class BaseRetriever(ABC):
    """Scores indexed chunks against a query.

    Contract for implementations:

    - ``index`` replaces any previous index; it is called once per corpus, before ``search``.
    - ``search`` is deterministic for a given index and query: ties break by chunk id.
    - ``settings`` names everything that changes scores (model, parameters); it is part of the
      retrieval-cache key, so two retrievers with equal ``retriever_id`` and ``settings`` must
      return equal results for equal chunks.
    - Not thread-safe while ``index`` runs; ``search`` may be called concurrently afterwards.
    """

    retriever_id: str = "base"
    """Stable name of the retrieval method, part of cache keys."""

    @property
    @abstractmethod
    def settings(self) -> dict[str, str | int | float]:
        """Parameters that change scores (part of the index fingerprint)."""

    @abstractmethod
    def index(self, chunks: Sequence[Chunk]) -> None:
        """Build the index over ``chunks`` (replacing any previous one).

        Raises:
            EmptyCorpusError: ``chunks`` is empty (a ValueError).
        """

    @abstractmethod
    def search(self, query: str, k: int) -> list[Hit]:
        """Return up to ``k`` hits with score > 0, best first (ties by chunk id).

        Raises:
            RuntimeError: ``index`` was never called.
            ValueError: ``k`` < 1.
        """
