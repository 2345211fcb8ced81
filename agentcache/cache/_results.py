"""The shared machinery behind ToolCache and RetrievalCache: look up, run once, store, count.

Single-flight: concurrent callers of one key in this process (threads or asyncio tasks, in any
event loop) wait for the one running call through a ``concurrent.futures.Future``. If that call
fails, nothing is stored or shared: each waiter retries (one becomes the next runner). Across
processes, a ``SharedFlightStore`` (RedisStore) elects the one runner with a fenced lease; over
any other store nothing is locked and at worst the work is duplicated (the last equal write wins).
NOTE: a tool that calls itself with the same key in the same thread would wait on itself forever.
Knows nothing about tools, arguments or retrievers: only keys and callables.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, NamedTuple

from agentcache.cache._codec import CodecError, decode, encode
from agentcache.cache.base import (
    CacheRecoveryWarning,
    CacheStats,
    CacheStore,
    FlightClaim,
    FlightLease,
    SharedFlightStore,
    UncacheableResultWarning,
)

__all__ = ["ResultCacheCore"]


class _Outcome(NamedTuple):
    ok: bool
    data: bytes | None  # encoded result (waiters decode their own copy); None if uncacheable
    value: Any  # the leader's result, handed to waiters only when ``data`` is None


_FAILED = _Outcome(False, None, None)
_MISS: Any = object()
_NO_CLAIM = FlightClaim(None, None)


class ResultCacheCore:
    """Lookup, single-flight execution, storage and hit/miss counting over one ``CacheStore``."""

    def __init__(self, store: CacheStore, *, allow_pickle: bool) -> None:
        self.store = store
        self.allow_pickle = allow_pickle
        self._shared = store if isinstance(store, SharedFlightStore) else None
        self._lock = threading.Lock()
        self._flights: dict[str, Future[_Outcome]] = {}
        self._warned: set[str] = set()
        self._hits = 0
        self._misses = 0

    def stats(self) -> CacheStats:
        """This object's hits and misses; entries and bytes of the whole store."""
        store_stats = self.store.stats()
        with self._lock:
            return CacheStats(self._hits, self._misses, store_stats.entries, store_stats.bytes)

    def run_sync(
        self, key: str, compute: Callable[[], Any], *, ttl_s: float | None, what: str
    ) -> Any:
        """Return the cached value for ``key`` or run ``compute`` once and store its result."""
        while True:
            value = self._lookup(key)
            if value is not _MISS:
                return value
            flight, is_leader = self._join(key)
            if not is_leader:
                value = self._from_outcome(flight.result())
                if value is not _MISS:
                    return value
                continue
            return self._lead_sync(key, flight, compute, ttl_s=ttl_s, what=what)

    async def run_async(
        self, key: str, compute: Callable[[], Awaitable[Any]], *, ttl_s: float | None, what: str
    ) -> Any:
        """Async twin of ``run_sync``: ``compute`` returns an awaitable."""
        while True:
            value = self._lookup(key)
            if value is not _MISS:
                return value
            flight, is_leader = self._join(key)
            if not is_leader:
                # NOTE: shield so a cancelled waiter does not cancel the leader's future.
                outcome = await asyncio.shield(asyncio.wrap_future(flight))
                value = self._from_outcome(outcome)
                if value is not _MISS:
                    return value
                continue
            outcome = _FAILED
            try:
                claim = _NO_CLAIM
                if self._shared is not None:  # the claim reads the value too
                    claim = await asyncio.to_thread(self._shared.claim, key)
                value = self._recheck(key, claim)
                if value is not _MISS:
                    outcome = _Outcome(True, None, value)
                    return value
                try:
                    value = await compute()
                    outcome = self._store(key, value, ttl_s=ttl_s, what=what, lease=claim.lease)
                finally:
                    _settle(claim.lease)
                return value
            finally:
                self._finish(key, flight, outcome)

    def _lead_sync(
        self,
        key: str,
        flight: Future[_Outcome],
        compute: Callable[[], Any],
        *,
        ttl_s: float | None,
        what: str,
    ) -> Any:
        outcome = _FAILED
        try:
            # NOTE: a shared store's claim reads the value in the same round trip (and may wait
            # for another process).
            claim = _NO_CLAIM if self._shared is None else self._shared.claim(key)
            value = self._recheck(key, claim)
            if value is not _MISS:
                outcome = _Outcome(True, None, value)
                return value
            try:
                value = compute()
                outcome = self._store(key, value, ttl_s=ttl_s, what=what, lease=claim.lease)
            finally:
                _settle(claim.lease)
            return value
        finally:
            self._finish(key, flight, outcome)

    def _recheck(self, key: str, claim: FlightClaim) -> Any:
        """The leader's second look before it computes, counted as a hit or a miss: the value
        its shared-store claim read, or (no shared store) a fresh read, since another thread
        may have stored it just before this one became the leader."""
        if self._shared is not None:
            value = self._decode_claim(key, claim)
        else:
            value = self._lookup_quiet(key)
        self._count(hit=value is not _MISS)
        return value

    def _join(self, key: str) -> tuple[Future[_Outcome], bool]:
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                return flight, False
            flight = Future()
            self._flights[key] = flight
            return flight, True

    def _finish(self, key: str, flight: Future[_Outcome], outcome: _Outcome) -> None:
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
        try:
            flight.set_result(outcome)
        except InvalidStateError:  # pragma: no cover - only if someone cancelled the future
            pass

    def _from_outcome(self, outcome: _Outcome) -> Any:
        if not outcome.ok:
            return _MISS
        self._count(hit=True)
        if outcome.data is None:
            return outcome.value
        return decode(outcome.data, allow_pickle=self.allow_pickle)

    def _lookup(self, key: str) -> Any:
        value = self._lookup_quiet(key)
        if value is not _MISS:
            self._count(hit=True)
        return value

    def _lookup_quiet(self, key: str) -> Any:
        data = self.store.get(key)
        if data is None:
            return _MISS
        try:
            return decode(data, allow_pickle=self.allow_pickle)
        except CodecError as exc:
            self.store.delete(key)
            warnings.warn(f"dropped unreadable cache entry: {exc}", CacheRecoveryWarning, 4)
            return _MISS

    def _decode_claim(self, key: str, claim: FlightClaim) -> Any:
        if claim.data is None:
            return _MISS
        try:
            return decode(claim.data, allow_pickle=self.allow_pickle)
        except CodecError as exc:
            self.store.delete(key)
            warnings.warn(f"dropped unreadable cache entry: {exc}", CacheRecoveryWarning, 4)
            return _MISS

    def _store(
        self, key: str, value: Any, *, ttl_s: float | None, what: str, lease: FlightLease | None
    ) -> _Outcome:
        try:
            data = encode(value, allow_pickle=self.allow_pickle)
        except CodecError as exc:
            self._warn_uncacheable(what, exc)
            return _Outcome(True, None, value)
        if lease is not None:
            lease.commit(data, ttl_s=ttl_s)  # refused if a newer lease took over (fencing)
        else:
            self.store.set(key, data, ttl_s=ttl_s)
        return _Outcome(True, data, None)

    def _warn_uncacheable(self, what: str, exc: CodecError) -> None:
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        warnings.warn(f"{what}: result not cached: {exc}", UncacheableResultWarning, 5)

    def _count(self, *, hit: bool) -> None:
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1


def _settle(lease: FlightLease | None) -> None:
    """Release a lease that was not committed (the computation raised, or was uncacheable)."""
    if lease is not None:
        lease.release()  # NOTE: a no-op after commit
