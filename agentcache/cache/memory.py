"""In-process ``CacheStore``: an LRU dict under a byte budget, for tests and single-process use.

Knows nothing about disks or other processes; everything is lost when the process ends.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from agentcache.cache.base import CacheStats, Clock, validate_size_limit, validate_ttl
from agentcache.exceptions import CacheIntegrityError

__all__ = ["MemoryStore"]

_DEFAULT_SIZE_LIMIT = 64 * 1024 * 1024


@dataclass(slots=True)
class _Entry:
    value: bytes
    expire_at: float | None
    size: int


class MemoryStore:
    """LRU ``CacheStore`` held in a dict; a hit moves the entry to the most-recently-used end.

    Args:
        size_limit_bytes: Budget for key plus value bytes; least-recently-used entries are evicted
            to stay within it (default 64 MiB).
        clock: Time source for TTLs, seconds (default ``time.time``; tests inject a fake).

    Raises:
        ValueError: ``size_limit_bytes`` is not a positive int.
    """

    def __init__(
        self, *, size_limit_bytes: int = _DEFAULT_SIZE_LIMIT, clock: Clock = time.time
    ) -> None:
        validate_size_limit(size_limit_bytes)
        self.size_limit_bytes = size_limit_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._num_bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        """See ``CacheStore.get``. Side effect: a hit bumps the entry's LRU position."""
        with self._lock:
            entry = self._entries.get(key)
            expire_at = None if entry is None else entry.expire_at
            if expire_at is not None and expire_at <= self._clock():
                self._remove(key)
                entry = None
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry.value

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        """See ``CacheStore.set``."""
        validate_ttl(ttl_s)
        size = len(key) + len(value)
        expire_at = None if ttl_s is None else self._clock() + ttl_s
        with self._lock:
            self._remove(key)
            if size > self.size_limit_bytes:
                return
            self._entries[key] = _Entry(bytes(value), expire_at, size)
            self._num_bytes += size
            while self._num_bytes > self.size_limit_bytes:
                oldest = next(iter(self._entries))
                self._remove(oldest)

    def delete(self, key: str) -> bool:
        """See ``CacheStore.delete``."""
        with self._lock:
            return self._remove(key)

    def clear(self) -> None:
        """See ``CacheStore.clear``."""
        with self._lock:
            self._entries.clear()
            self._num_bytes = 0

    def stats(self) -> CacheStats:
        """See ``CacheStore.stats``."""
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._entries), self._num_bytes)

    def check_integrity(self) -> None:
        """Byte accounting matches the entries and stays within the budget.

        Raises:
            CacheIntegrityError: the byte counter or budget invariant is broken.
        """
        with self._lock:
            total = sum(entry.size for entry in self._entries.values())
            if total != self._num_bytes:
                raise CacheIntegrityError(f"byte counter {self._num_bytes} != entry sum {total}")
            if total > self.size_limit_bytes:
                raise CacheIntegrityError(f"{total} bytes exceed limit {self.size_limit_bytes}")
            bad = [k for k, e in self._entries.items() if e.size != len(k) + len(e.value)]
            if bad:
                raise CacheIntegrityError(f"entry sizes wrong for keys {bad[:3]!r}")

    def close(self) -> None:
        """Drop every entry (a memory store has nothing else to release)."""
        self.clear()

    def _remove(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._num_bytes -= entry.size
        return True
