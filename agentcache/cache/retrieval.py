"""``RetrievalCache``: cache retriever results by (retriever, index fingerprint, query, k, filters,
scope).

The index fingerprint (``index_fingerprint``) covers the corpus contents and chunking settings, so
re-indexing a changed corpus re-keys every entry. Results come back equal and in the same order.
Knows nothing about how retrieval works; ``compute`` does it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from agentcache.cache._results import ResultCacheCore
from agentcache.cache.base import CacheStats, CacheStore, validate_ttl
from agentcache.cache.keys import normalize_query, retrieval_key
from agentcache.cache.scope import ScopeKind, scope_key, validate_scope_kind
from agentcache.canonical import canonical_json
from agentcache.exceptions import CanonicalizationError

__all__ = ["RetrievalCache"]

T = TypeVar("T")


class RetrievalCache:
    """Result cache for retrievers.

    Args:
        store: Where entries live.
        namespace: Key prefix (default ``"retrieval"``).
        scope: Who shares entries (rule in ``agentcache.cache.scope``): by default every id the
            active ``cache_scope`` sets; ``"global"`` opts in to sharing one corpus's results
            with everyone.
        ttl_s: Seconds an entry stays valid (default: until evicted or the index changes).
        casefold_queries: Also casefold queries in the key; only for case-insensitive retrievers
            (see ``normalize_query``).
        allow_pickle: As for ``ToolCache``; chunk dataclasses and pydantic models need no pickle.

    Raises:
        ConfigError: invalid ``scope``.
        ValueError: ``ttl_s`` is not positive.
    """

    def __init__(
        self,
        store: CacheStore,
        *,
        namespace: str = "retrieval",
        scope: ScopeKind = "narrowest",
        ttl_s: float | None = None,
        casefold_queries: bool = False,
        allow_pickle: bool = False,
    ) -> None:
        validate_ttl(ttl_s)
        self.namespace = namespace
        self.scope = validate_scope_kind(scope)
        self.ttl_s = ttl_s
        self.casefold_queries = casefold_queries
        self._core = ResultCacheCore(store, allow_pickle=allow_pickle)

    def key(
        self,
        *,
        retriever_id: str,
        index_fingerprint: str,
        query: str,
        k: int,
        filters: Mapping[str, Any] | None = None,
    ) -> str:
        """The cache key ``get_or_compute`` uses for these inputs in the current scope.

        Raises:
            ValueError: ``k`` is not a positive int.
            CacheScopeError: the scope needs an id ``cache_scope`` does not set.
            CanonicalizationError: ``filters`` has no canonical JSON form.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"k must be a positive int, got {k!r}")
        what = f"retriever {retriever_id!r}"
        try:
            filters_json = canonical_json(dict(filters) if filters is not None else None)
        except CanonicalizationError as exc:
            raise CanonicalizationError(f"{what}: filters cannot be part of a key: {exc}") from exc
        return retrieval_key(
            self.namespace,
            retriever_id,
            index_fingerprint,
            normalize_query(query, casefold=self.casefold_queries),
            k,
            filters_json,
            scope_key(self.scope, what=what),
        )

    def get_or_compute(
        self,
        *,
        retriever_id: str,
        index_fingerprint: str,
        query: str,
        k: int,
        filters: Mapping[str, Any] | None = None,
        compute: Callable[[], list[T]],
    ) -> list[T]:
        """Return the cached results for these inputs, or run ``compute`` once and cache them.

        Concurrent identical calls in this process run ``compute`` once. Exceptions from
        ``compute`` propagate and are not cached.

        Args:
            retriever_id: Names the retriever and its configuration (e.g. ``"bm25:v1"``).
            index_fingerprint: ``index_fingerprint(chunks, **settings)`` of the indexed corpus.
            query: Query text; normalized as ``normalize_query`` documents.
            k: Number of results asked for.
            filters: Metadata filters, canonicalized (key order does not matter).
            compute: Runs the retrieval; returns the results in rank order.

        Raises:
            As ``key``, plus whatever ``compute`` raises.
        """
        key = self.key(
            retriever_id=retriever_id,
            index_fingerprint=index_fingerprint,
            query=query,
            k=k,
            filters=filters,
        )
        what = f"retriever {retriever_id!r}"
        result = self._core.run_sync(key, functools.partial(compute), ttl_s=self.ttl_s, what=what)
        return cast(list[T], result)

    def stats(self) -> CacheStats:
        """Hits and misses of this object; entries and bytes of the whole store."""
        return self._core.stats()
