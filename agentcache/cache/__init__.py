"""Tool-result and retrieval-result caches over swappable byte stores.

``ToolCache`` and ``RetrievalCache`` build keys from canonical inputs plus a scope and keep values
in a ``CacheStore``: ``MemoryStore`` (in-process), ``DiskStore`` (diskcache/SQLite, shared by
processes) or ``RedisStore`` (shared by machines). ``create_store`` builds one by name.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from agentcache import env
from agentcache.cache.base import (
    CacheRecoveryWarning,
    CacheStats,
    CacheStore,
    CacheWarning,
    NetworkFilesystemWarning,
    SharedFlightStore,
    UncacheableResultWarning,
)
from agentcache.cache.disk import DiskStore
from agentcache.cache.embedding import EmbeddingCache
from agentcache.cache.keys import index_fingerprint, normalize_query
from agentcache.cache.memory import MemoryStore
from agentcache.cache.retrieval import RetrievalCache
from agentcache.cache.scope import ScopeKind, ScopeValues, cache_scope, current_scope
from agentcache.cache.tool import ToolCache
from agentcache.exceptions import CacheIntegrityError, CacheScopeError, ConfigError

if TYPE_CHECKING:
    from agentcache.cache.redis import RedisStore

__all__ = [
    "CacheIntegrityError",
    "CacheRecoveryWarning",
    "CacheScopeError",
    "CacheStats",
    "CacheStore",
    "CacheWarning",
    "DiskStore",
    "EmbeddingCache",
    "MemoryStore",
    "NetworkFilesystemWarning",
    "RedisStore",
    "RetrievalCache",
    "ScopeKind",
    "ScopeValues",
    "SharedFlightStore",
    "ToolCache",
    "UncacheableResultWarning",
    "cache_scope",
    "create_store",
    "current_scope",
    "index_fingerprint",
    "normalize_query",
]

STORES = ("memory", "disk", "redis")
"""Names accepted by ``create_store``."""


def create_store(
    kind: str,
    directory: str | os.PathLike[str] | None = None,
    *,
    url: str | None = None,
    **options: Any,
) -> CacheStore:
    """Build a store by name: ``"memory"``, ``"disk"`` (needs ``directory``) or ``"redis"``.

    Args:
        kind: One of ``STORES``.
        directory: Cache folder for ``"disk"``.
        url: Server of ``"redis"`` (default ``AGENTCACHE_REDIS_URL``).
        **options: Keyword options of the store class (``size_limit_bytes``, ``clock``, ...).

    Raises:
        ConfigError: unknown ``kind`` (the message lists the valid names), ``"disk"`` without
            ``directory``, ``"redis"`` without a url, or ``url`` given for another kind.
    """
    if url is not None and kind != "redis":
        raise ConfigError(f"create_store({kind!r}) takes no url; only 'redis' does")
    if kind == "redis":
        redis_url = url or env.redis_url()
        if redis_url is None:
            raise ConfigError("create_store('redis') needs url= or AGENTCACHE_REDIS_URL")
        return _redis_store_class()(redis_url, **options)
    if kind == "memory":
        return MemoryStore(**options)
    if kind == "disk":
        if directory is None:
            raise ConfigError("create_store('disk') needs a directory")
        return DiskStore(directory, **options)
    raise ConfigError(f"unknown cache store {kind!r}; valid names: {', '.join(STORES)}")


def _redis_store_class() -> type[RedisStore]:
    try:
        from agentcache.cache.redis import RedisStore
    except ImportError as exc:  # redis-py is an optional extra
        raise ConfigError(
            f"RedisStore needs redis-py ({exc}); install it with: pip install 'agentcache[redis]'"
        ) from exc
    return RedisStore


def __getattr__(name: str) -> Any:
    """Import ``RedisStore`` lazily, so ``agentcache.cache`` works without redis-py."""
    if name == "RedisStore":
        return _redis_store_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
