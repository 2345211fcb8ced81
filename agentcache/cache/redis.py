"""``RedisStore``: a ``CacheStore`` on a Redis server, shared by every worker process and machine.

Values carry the checksummed envelope of ``DiskStore`` and a native Redis TTL. The byte budget of
the whole cache is the server's ``maxmemory`` with an eviction policy (``allkeys-lru`` suggested);
the store itself only refuses single entries over ``max_entry_bytes``. Missing keys are computed
once across processes through fenced leases (``_lock``). Knows nothing about what the bytes mean.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agentcache.cache._envelope import HEADER_SIZE, open_envelope, pack, unpack
from agentcache.cache._lock import LeaseScripts, RedisLease
from agentcache.cache.base import (
    CacheStats,
    CacheWarning,
    Clock,
    FlightClaim,
    validate_ttl,
)
from agentcache.exceptions import CacheIntegrityError, ConfigError

__all__ = ["RedisStore"]

T = TypeVar("T")

_DEFAULT_MAX_ENTRY = 16 * 1024 * 1024
_SCAN_COUNT = 500
_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class RedisStore:
    """``CacheStore`` (and ``SharedFlightStore``) on one Redis server or primary.

    Entries live under ``<namespace>:v:<key>``; two stores share entries only if their namespaces
    match. A hit refreshes the key's recency in the server's LRU. If the server is unreachable, a
    ``CacheWarning`` is emitted once per outage, reads answer a miss and writes are skipped; the
    store reconnects by itself at most every ``retry_interval_s``. Redis Cluster is not supported
    (the lease scripts touch a shared counter key).

    Args:
        url: ``redis://[:password@]host:port/db`` (or ``rediss://``, ``unix://``).
        namespace: Key prefix on the server (default ``"agentcache"``); no ``:``, so that no
            namespace's keys start with another's.
        max_entry_bytes: Largest envelope stored; a larger value is not stored and removes any
            previous one (default 16 MiB). The total is the server's ``maxmemory``.
        clock: Time source of the envelope expiry, seconds since the epoch (default
            ``time.time``); the native TTL in milliseconds is set as well.
        lock_ttl_s: Lock expiry of a lease, seconds (default 30): the longest a crashed holder
            delays its key. A tool slower than this may run twice; only the newest lease's result
            is stored.
        wait_timeout_s: How long a caller waits for another process's lease before computing
            the value itself (default: ``lock_ttl_s``).
        poll_s: First wait between claim attempts, seconds (grows 1.5x up to 50 ms; default 5 ms).
        timeout_s: Socket connect/read timeout, seconds (default 1).
        retry_interval_s: After a connection failure, calls skip Redis for this long (default 1).
        client: An existing redis-py client to use instead of ``url`` (not closed by ``close``;
            it must not set ``decode_responses``).

    Raises:
        ConfigError: neither ``url`` nor ``client``, or a bad url.
        ValueError: a non-positive size or duration.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str = "agentcache",
        max_entry_bytes: int = _DEFAULT_MAX_ENTRY,
        clock: Clock = time.time,
        lock_ttl_s: float = 30.0,
        wait_timeout_s: float | None = None,
        poll_s: float = 0.005,
        timeout_s: float = 1.0,
        retry_interval_s: float = 1.0,
        client: redis.Redis | None = None,
    ) -> None:
        if isinstance(max_entry_bytes, bool) or not isinstance(max_entry_bytes, int):
            raise ValueError(f"max_entry_bytes must be an int, got {max_entry_bytes!r}")
        if max_entry_bytes <= HEADER_SIZE:
            raise ValueError(f"max_entry_bytes must exceed {HEADER_SIZE}, got {max_entry_bytes!r}")
        durations = {
            "lock_ttl_s": lock_ttl_s,
            "wait_timeout_s": lock_ttl_s if wait_timeout_s is None else wait_timeout_s,
            "poll_s": poll_s,
            "timeout_s": timeout_s,
            "retry_interval_s": retry_interval_s,
        }
        for name, seconds in durations.items():
            _check_seconds(name, seconds)
        if not isinstance(namespace, str) or not namespace or ":" in namespace:
            raise ConfigError(
                f"RedisStore namespace must be a non-empty str without ':', got {namespace!r}"
            )
        self.namespace = namespace
        self.max_entry_bytes = max_entry_bytes
        self.lock_ttl_s = lock_ttl_s
        self.wait_timeout_s = lock_ttl_s if wait_timeout_s is None else wait_timeout_s
        self._poll_s = poll_s
        self._clock = clock
        self._retry_interval_s = retry_interval_s
        self._owns_client = client is None
        self._client = client if client is not None else _connect(url, timeout_s)
        self.where = _describe(url) if client is None else repr(client)
        self._scripts = LeaseScripts(self._client, namespace, lock_ttl_s=lock_ttl_s)
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._down_until = 0.0
        self._is_down = False

    # -- CacheStore ------------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """See ``CacheStore.get``. One round trip; answers a miss while Redis is unreachable."""
        raw = self.guarded(lambda c: c.get(self._scripts.value_key(key)), None)
        value = self._open(key, raw) if isinstance(raw, bytes) else None
        with self._lock:
            if value is None:
                self._misses += 1
            else:
                self._hits += 1
        return value

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        """See ``CacheStore.set``. Last write wins; skipped while Redis is unreachable."""
        validate_ttl(ttl_s)
        packed = self._pack(key, value, ttl_s)
        if packed is None:
            self.delete(key)
            return
        envelope, px = packed
        name = self._scripts.value_key(key)
        self.guarded(lambda c: c.set(name, envelope, px=px or None), None)

    def delete(self, key: str) -> bool:
        """See ``CacheStore.delete``."""
        return bool(self.guarded(lambda c: c.delete(self._scripts.value_key(key)), 0))

    def clear(self) -> None:
        """Remove every entry and lease of this namespace (other namespaces are untouched)."""

        def wipe(client: redis.Redis) -> None:
            batch: list[bytes] = []
            for name in client.scan_iter(match=f"{self._glob()}*", count=_SCAN_COUNT):
                batch.append(name)
                if len(batch) >= _SCAN_COUNT:
                    client.unlink(*batch)
                    batch.clear()
            if batch:
                client.unlink(*batch)

        self.guarded(wipe, None)

    def stats(self) -> CacheStats:
        """See ``CacheStore.stats``. ``entries`` and ``bytes`` (key plus envelope bytes) cover
        every process's entries in this namespace; O(entries) (a SCAN), zero while unreachable."""

        def count(client: redis.Redis) -> tuple[int, int]:
            names = list(self._value_names(client))
            if not names:
                return 0, 0
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            sizes = pipe.execute()
            return len(names), sum(sizes) + sum(len(n) for n in names)

        entries, num_bytes = self.guarded(count, (0, 0))
        with self._lock:
            return CacheStats(self._hits, self._misses, entries, num_bytes)

    def check_integrity(self) -> None:
        """Verify every entry's envelope and that every live lock expires. O(entries).

        Raises:
            CacheIntegrityError: a damaged entry, a lock without expiry, or Redis unreachable.
        """
        try:
            problems = self._problems()
        except _REDIS_ERRORS as exc:
            raise CacheIntegrityError(f"redis at {self.where}: {exc}") from exc
        if problems:
            raise CacheIntegrityError(f"redis at {self.where}: {'; '.join(problems)}")

    def close(self) -> None:
        """Close the connection pool (only if this store created the client)."""
        if self._owns_client:
            self._client.close()

    # -- SharedFlightStore -----------------------------------------------------------------------

    def claim(self, key: str) -> FlightClaim:
        """See ``SharedFlightStore.claim``: wait at most ``wait_timeout_s`` for another holder."""
        deadline = time.monotonic() + self.wait_timeout_s
        delay = self._poll_s
        attempt = self._scripts.attempt
        while True:
            found = self.guarded(lambda c: attempt(c, key), None)
            if found is None:  # Redis unreachable: compute without a lease
                return FlightClaim(None, None)
            if isinstance(found, bytes):
                data = self._open(key, found)
                if data is not None:
                    return FlightClaim(data, None)
                continue  # a damaged or expired entry was dropped: claim again
            if found > 0:
                return FlightClaim(None, RedisLease(self, self._scripts, key, found, self._pack))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return FlightClaim(None, None)
            time.sleep(min(delay, remaining))
            delay = min(delay * 1.5, 0.05)

    # -- internals -------------------------------------------------------------------------------

    def guarded(self, op: Callable[[redis.Redis], T], default: T) -> T:
        """Run ``op`` on the client; on a connection failure warn once and answer ``default``."""
        if self._is_down and time.monotonic() < self._down_until:
            return default
        try:
            result = op(self._client)
        except _REDIS_ERRORS as exc:
            self._mark_down(exc)
            return default
        except redis.ResponseError as exc:  # e.g. OOM under maxmemory noeviction, READONLY
            warnings.warn(f"redis at {self.where}: {exc}; skipped", CacheWarning, stacklevel=3)
            return default
        if self._is_down:
            with self._lock:
                self._is_down = False
        return result

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self._retry_interval_s
            was_down, self._is_down = self._is_down, True
        if not was_down:
            message = (
                f"redis at {self.where} unreachable ({type(exc).__name__}: {exc}); computing "
                f"without the shared cache, retrying every {self._retry_interval_s:g} s"
            )
            warnings.warn(message, CacheWarning, stacklevel=4)

    def _pack(self, key: str, value: bytes, ttl_s: float | None) -> tuple[bytes, int] | None:
        expire_at = 0.0 if ttl_s is None else self._clock() + ttl_s
        if HEADER_SIZE + len(value) > self.max_entry_bytes:
            return None
        px = 0 if ttl_s is None else max(1, math.ceil(ttl_s * 1000))
        return pack(key, expire_at, value), px

    def _open(self, key: str, raw: bytes) -> bytes | None:
        return open_envelope(key, raw, clock=self._clock, drop=self.delete)

    def _glob(self) -> str:
        return _glob_escape(self.namespace) + ":"

    def _value_names(self, client: redis.Redis) -> Iterator[bytes]:
        yield from client.scan_iter(match=f"{self._glob()}v:*", count=_SCAN_COUNT)

    def _problems(self) -> list[str]:
        problems = []
        value_prefix = len(self._scripts.value_key(""))
        for name in self._value_names(self._client):
            raw = self._client.get(name)
            key = name.decode("utf-8", "replace")[value_prefix:]
            if raw is not None and unpack(key, raw) is None:
                problems.append(f"entry {key!r} fails its checksum")
        lock_glob = f"{self._glob()}lock:*"
        for name in self._client.scan_iter(match=lock_glob, count=_SCAN_COUNT):
            if self._client.pttl(name) == -1:
                problems.append(f"lock {name!r} has no expiry")
        return problems


def _check_seconds(name: str, seconds: float) -> None:
    is_number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    if not is_number or not 0 < seconds < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")


def _glob_escape(text: str) -> str:
    """``text`` with Redis glob metacharacters escaped, for ``SCAN MATCH``."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def _connect(url: str | None, timeout_s: float) -> redis.Redis:
    if not url:
        raise ConfigError(
            "RedisStore needs a url (redis://host:port/db) or a client; "
            "set AGENTCACHE_REDIS_URL or pass url="
        )
    try:
        return redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # NOTE: the store's own outage handling replaces retries
        )
    except ValueError as exc:
        raise ConfigError(f"bad redis url {_describe(url)!r}: {exc}") from exc


def _describe(url: str | None) -> str:
    """The url without its password, for messages."""
    if not url:
        return "?"
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
