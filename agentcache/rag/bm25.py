"""BM25 retrieval over chunks with the ``bm25s`` library (the default retriever).

Tokenization is a fixed lower-cased word regex plus a small English stopword list, so scores
depend only on the text. Knows nothing about caching or prompt order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import bm25s

from agentcache.exceptions import EmptyCorpusError
from agentcache.rag.base import BaseRetriever, Hit
from agentcache.rag.chunking import Chunk

__all__ = ["BM25Retriever", "tokenize"]

_WORD = re.compile(r"[a-z0-9_]{2,}")
_STOPWORDS = frozenset(
    "a an and are as at be by for from has have how if in into is it its of on or that the "
    "this to was what when where which who why will with does do can you your".split()
)


def tokenize(text: str) -> list[str]:
    """Lower-case words of 2+ characters (letters, digits, ``_``), stopwords removed.

    ``json.loads`` gives ``["json", "loads"]``; identifiers such as ``load_folder`` stay whole.
    """
    return [word for word in _WORD.findall(text.lower()) if word not in _STOPWORDS]


class BM25Retriever(BaseRetriever):
    """Okapi BM25 (Lucene variant, bm25s defaults k1=1.5, b=0.75)."""

    retriever_id = "bm25"

    def __init__(self, *, k1: float = 1.5, b: float = 0.75) -> None:
        """Create an empty retriever with BM25 parameters ``k1`` and ``b``."""
        self._k1 = k1
        self._b = b
        self._chunks: list[Chunk] = []
        self._model: bm25s.BM25 | None = None

    @property
    def settings(self) -> dict[str, str | int | float]:
        """BM25 parameters and the tokenizer version."""
        return {"k1": self._k1, "b": self._b, "method": "lucene", "tokenizer": "word2-v1"}

    def index(self, chunks: Sequence[Chunk]) -> None:
        """Index ``chunks`` (see ``BaseRetriever.index``)."""
        if not chunks:
            raise EmptyCorpusError(
                "cannot index an empty corpus: pass at least one non-empty chunk"
            )
        self._chunks = list(chunks)
        model = bm25s.BM25(k1=self._k1, b=self._b, method="lucene")
        # NOTE: an all-stopword chunk still needs one token or bm25s drops it from the matrix.
        model.index([tokenize(c.text) or ["_"] for c in self._chunks], show_progress=False)
        self._model = model

    def search(self, query: str, k: int) -> list[Hit]:
        """Best ``k`` chunks for ``query`` (see ``BaseRetriever.search``)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")
        if self._model is None:
            raise RuntimeError("BM25Retriever.search called before index()")
        terms = [t for t in tokenize(query) if t in self._model.vocab_dict]
        if not terms:
            return []
        scores = self._model.get_scores(terms)
        ranked = sorted(
            (i for i in range(len(self._chunks)) if scores[i] > 0),
            key=lambda i: (-float(scores[i]), self._chunks[i].id),
        )
        return [Hit(self._chunks[i], float(scores[i])) for i in ranked[:k]]
