"""Tool-result and retrieval-result caches over swappable byte stores.

``ToolCache`` and ``RetrievalCache`` build keys from canonical inputs plus a scope and keep values
in a ``CacheStore``: ``MemoryStore`` (in-process) or ``DiskStore`` (diskcache/SQLite, shared by
processes). ``create_store`` builds one by name.
"""

from __future__ import annotations

import os
from typing import Any

from agentcache.cache.base import (
    CacheRecoveryWarning,
    CacheStats,
    CacheStore,
    CacheWarning,
    UncacheableResultWarning,
)
from agentcache.cache.disk import DiskStore
from agentcache.cache.keys import index_fingerprint, normalize_query
from agentcache.cache.memory import MemoryStore
from agentcache.cache.retrieval import RetrievalCache
from agentcache.cache.scope import ScopeKind, ScopeValues, cache_scope, current_scope
from agentcache.cache.tool import ToolCache
from agentcache.exceptions import CacheIntegrityError, CacheScopeError, ConfigError

__all__ = [
    "CacheIntegrityError",
    "CacheRecoveryWarning",
    "CacheScopeError",
    "CacheStats",
    "CacheStore",
    "CacheWarning",
    "DiskStore",
    "MemoryStore",
    "RetrievalCache",
    "ScopeKind",
    "ScopeValues",
    "ToolCache",
    "UncacheableResultWarning",
    "cache_scope",
    "create_store",
    "current_scope",
    "index_fingerprint",
    "normalize_query",
]

STORES = ("memory", "disk")
"""Names accepted by ``create_store``."""


def create_store(
    kind: str, directory: str | os.PathLike[str] | None = None, **options: Any
) -> CacheStore:
    """Build a store by name: ``"memory"`` or ``"disk"`` (which needs ``directory``).

    Args:
        kind: One of ``STORES``.
        directory: Cache folder for ``"disk"``.
        **options: Keyword options of the store class (``size_limit_bytes``, ``clock``, ...).

    Raises:
        ConfigError: unknown ``kind`` (the message lists the valid names), or ``"disk"`` without
            ``directory``.
    """
    if kind == "memory":
        return MemoryStore(**options)
    if kind == "disk":
        if directory is None:
            raise ConfigError("create_store('disk') needs a directory")
        return DiskStore(directory, **options)
    raise ConfigError(f"unknown cache store {kind!r}; valid names: {', '.join(STORES)}")
