"""``EmbeddingCache``: text embeddings keyed by (model id, revision, normalized text hash, scope).

Vectors live in any ``CacheStore`` as little-endian float32 bytes behind a small header (format
tag, dimension), so a rebuild of an unchanged corpus embeds nothing and a changed corpus embeds
only its new texts. The scope follows the rule in ``agentcache.cache.scope``. Knows nothing about
which model computes the vectors: ``embed`` does.
"""

from __future__ import annotations

import hashlib
import struct
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from agentcache.cache.base import CacheStats, CacheStore
from agentcache.cache.scope import ScopeKind, scope_key, validate_scope_kind
from agentcache.canonical import stable_hash
from agentcache.exceptions import ConfigError

__all__ = ["EmbeddingCache", "normalize_text_for_embedding"]

_TAG = "agentcache.embedding.v1"
_HEADER = struct.Struct("<4sI")  # format tag, dimension
_MAGIC = b"EMB1"

Vectors = npt.NDArray[np.float32]


def normalize_text_for_embedding(text: str) -> str:
    """Text as it enters an embedding key: NFC only (whitespace and case reach the model)."""
    return unicodedata.normalize("NFC", text)


class EmbeddingCache:
    """Embeddings of texts under one model, in a ``CacheStore``.

    Args:
        store: Where vectors live (``MemoryStore``, ``DiskStore``, ``RedisStore``...).
        model_id: Names the model (for example its folder or hub id).
        revision: Version of the weights (a commit, or a fingerprint of the files); a changed
            model must change it.
        scope: Who shares entries (rule in ``agentcache.cache.scope``; default: every id the
            active ``cache_scope`` sets; ``"global"`` shares one corpus's vectors with everyone).
        namespace: Key prefix (default ``"embeddings"``).

    Raises:
        ConfigError: empty ``model_id`` or ``revision``, or an invalid ``scope``.
    """

    def __init__(
        self,
        store: CacheStore,
        *,
        model_id: str,
        revision: str,
        scope: ScopeKind = "narrowest",
        namespace: str = "embeddings",
    ) -> None:
        for name, value in (("model_id", model_id), ("revision", revision)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"EmbeddingCache needs a non-empty {name}, got {value!r}")
        self.store = store
        self.model_id = model_id
        self.revision = revision
        self.scope = validate_scope_kind(scope)
        self.namespace = namespace
        self._hits = 0
        self._misses = 0

    def key(self, text: str) -> str:
        """Key of ``text``'s vector in the current scope.

        Raises:
            CacheScopeError: the scope needs an id ``cache_scope`` does not set.
        """
        digest = hashlib.sha256(normalize_text_for_embedding(text).encode("utf-8")).hexdigest()
        scope_json = scope_key(self.scope, what=f"embeddings of {self.model_id!r}")
        return stable_hash(_TAG, self.namespace, self.model_id, self.revision, digest, scope_json)

    def get_or_embed(self, texts: Sequence[str], embed: Callable[[list[str]], Any]) -> Vectors:
        """Vectors of ``texts`` (``[len(texts), dim]`` float32), embedding only the misses.

        Args:
            texts: Texts in order; duplicates (after NFC) are embedded once, as NFC text.
            embed: Computes vectors for a list of texts (``[n, dim]``, any float array).

        Returns:
            One row per text, in order.

        Raises:
            ValueError: ``embed`` returned the wrong number of rows or mixed dimensions.
            CacheScopeError: as ``key``.
        """
        keys = [self.key(text) for text in texts]
        found: dict[str, Vectors] = {}
        for key in dict.fromkeys(keys):
            vector = _decode(self.store.get(key))
            if vector is not None:
                found[key] = vector
        missing: dict[str, str] = {}
        for key, text in zip(keys, texts, strict=True):
            if key not in found:  # NOTE: the model sees the normalized text the key names.
                missing.setdefault(key, normalize_text_for_embedding(text))
        self._hits += len(keys) - sum(1 for key in keys if key in missing)
        self._misses += len(missing)
        if missing:
            computed = np.asarray(embed(list(missing.values())), dtype=np.float32)
            if computed.ndim != 2 or computed.shape[0] != len(missing):
                raise ValueError(f"embed returned shape {computed.shape} for {len(missing)} texts")
            for key, row in zip(missing, computed, strict=True):
                self.store.set(key, _encode(row))
                found[key] = row
        if not keys:
            return np.zeros((0, 0), dtype=np.float32)
        dims = {found[key].shape[0] for key in keys}
        if len(dims) != 1:
            raise ValueError(f"cached vectors have mixed dimensions {sorted(dims)}")
        return np.stack([found[key] for key in keys])

    def stats(self) -> CacheStats:
        """Texts served from the store (hits) and embedded (misses); the store's size."""
        store_stats = self.store.stats()
        return CacheStats(self._hits, self._misses, store_stats.entries, store_stats.bytes)


def _encode(vector: Vectors) -> bytes:
    row = np.ascontiguousarray(vector, dtype="<f4")
    return _HEADER.pack(_MAGIC, row.shape[0]) + row.tobytes()


def _decode(data: bytes | None) -> Vectors | None:
    """The stored vector, or ``None`` for a miss or bytes of another format (never wrong data)."""
    if data is None or len(data) < _HEADER.size:
        return None
    magic, dim = _HEADER.unpack_from(data)
    if magic != _MAGIC or len(data) != _HEADER.size + 4 * dim:
        return None
    return np.frombuffer(data, dtype="<f4", offset=_HEADER.size).astype(np.float32)
