"""The ``CacheStore`` contract shared by every result-cache backend, plus stats and warnings.

A store maps ``str`` keys (hex digests built by ``agentcache.cache.keys``) to opaque ``bytes``
values with an optional time to live. It knows nothing about tools, retrievers, scopes or how
values are serialized; that keeps a shared backend (for example Redis) a drop-in addition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "CacheRecoveryWarning",
    "CacheStats",
    "CacheStore",
    "CacheWarning",
    "Clock",
    "FlightClaim",
    "FlightLease",
    "NetworkFilesystemWarning",
    "SharedFlightStore",
    "UncacheableResultWarning",
]

Clock: TypeAlias = Callable[[], float]
"""Returns the current time in seconds since the epoch (``time.time``); TTLs are measured on it.

Wall-clock time rather than a monotonic clock, because expiry times written by one process are read
by others sharing the same directory."""


class CacheWarning(UserWarning):
    """Base class of the warnings the result caches emit (the call itself still succeeds)."""


class CacheRecoveryWarning(CacheWarning):
    """A store was missing, corrupted or unreadable and was recreated, or a bad entry was dropped.

    The operation that noticed it is answered as a miss (reads) or skipped (writes); the caller
    still gets the tool's real result.
    """


class NetworkFilesystemWarning(CacheWarning):
    """A ``DiskStore`` folder is on a network filesystem (NFS, SMB, sshfs...), where SQLite's
    file locking is unsafe (https://www.sqlite.org/howtocorrupt.html, section 2.1)."""


class UncacheableResultWarning(CacheWarning):
    """A result has no exact serialized form and was not stored (warned once per tool)."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of one store or one cache object.

    Attributes:
        hits: Lookups answered from the cache (for a ``ToolCache``: calls served without running
            the tool, including concurrent callers that waited for the one running call).
        misses: Lookups that found nothing (for a ``ToolCache``: calls that ran the tool).
        entries: Entries currently stored, expired-but-not-yet-evicted ones included.
        bytes: Bytes the store occupies: key plus value bytes for ``MemoryStore``, the on-disk
            size including SQLite pages for ``DiskStore``.
    """

    hits: int
    misses: int
    entries: int
    bytes: int

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``; 0.0 before the first lookup."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def since(self, earlier: CacheStats) -> CacheStats:
        """Hits and misses counted after ``earlier`` was taken (for per-turn reporting).

        ``entries`` and ``bytes`` are the current values, not differences.
        """
        return CacheStats(
            hits=self.hits - earlier.hits,
            misses=self.misses - earlier.misses,
            entries=self.entries,
            bytes=self.bytes,
        )


@runtime_checkable
class CacheStore(Protocol):
    """Byte-valued key/value store with per-entry TTL, a byte budget and eviction.

    Every method is safe to call from several threads at once. Stores never raise on ``get`` or
    ``set`` because of a damaged or vanished backing medium: they recover, emit
    ``CacheRecoveryWarning`` and answer a miss (``get``) or drop the write (``set``). Hit and miss
    counters are per store object, in memory, and cheap to read.
    """

    def get(self, key: str) -> bytes | None:
        """Return the value stored under ``key``, or ``None`` if absent or expired.

        Counts one hit or one miss. An expired or corrupt entry found here is deleted. Whether a hit
        refreshes the entry's eviction order is up to the implementation (documented there).
        """
        ...

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        """Store ``value`` under ``key``, replacing any previous value.

        Args:
            key: Cache key; implementations may assume short ASCII (hex digests).
            value: Bytes to store. A value larger than the whole byte budget is not stored (and any
                previous value under ``key`` is removed).
            ttl_s: Seconds until the entry expires, measured on the store's clock; ``None`` keeps
                it until evicted.

        Raises:
            ValueError: ``ttl_s`` is not a positive number.

        Side effects: may evict other entries to stay within the byte budget.
        """
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; return whether an entry was removed."""
        ...

    def clear(self) -> None:
        """Remove every entry. Hit and miss counters are kept."""
        ...

    def stats(self) -> CacheStats:
        """Return current counters (see ``CacheStats``)."""
        ...

    def check_integrity(self) -> None:
        """Verify the store's internal invariants (byte accounting, database consistency).

        Raises:
            CacheIntegrityError: an invariant does not hold; the message says which.
        """
        ...

    def close(self) -> None:
        """Release files and connections; the store must not be used afterwards."""
        ...


class FlightLease(Protocol):
    """The right, held across processes, to compute one missing key and store its result.

    Obtained from ``SharedFlightStore.claim``. Exactly one of ``commit`` or ``release`` takes
    effect; later calls do nothing. A lease that is never settled (its process died) expires on
    its own, so no one waits for it longer than the store's lock expiry.
    """

    token: int
    """Fencing token: strictly increasing across every lease the store ever hands out."""

    def commit(self, value: bytes, *, ttl_s: float | None) -> bool:
        """Store ``value`` (as ``CacheStore.set`` would) and release the lease, atomically.

        Returns:
            ``False`` when the write was refused: a newer lease was handed out after this one
            expired (the fencing rule: a stale holder never overwrites), the value is over the
            budget, or the store is unreachable.
        """
        ...

    def release(self) -> None:
        """Give the lease up without storing anything (the computation failed)."""
        ...


class FlightClaim(NamedTuple):
    """What ``SharedFlightStore.claim`` ended with.

    Attributes:
        data: The value another process stored while this one waited, or ``None``.
        lease: The lease to compute the value, or ``None``.

    Neither set: the wait timed out or the store is unreachable; compute without a lease.
    """

    data: bytes | None
    lease: FlightLease | None


@runtime_checkable
class SharedFlightStore(CacheStore, Protocol):
    """A ``CacheStore`` that also elects one computing caller per missing key across processes."""

    def claim(self, key: str) -> FlightClaim:
        """Take the lease for ``key``, or wait for its holder to store a value.

        Blocks (polling) at most the store's wait timeout, then gives up with an empty claim so
        the caller computes the value itself: a caller never hangs on a lost or slow holder.
        Does not count a hit or a miss in the store's stats.
        """
        ...


def validate_ttl(ttl_s: float | None) -> None:
    """Raise ``ValueError`` unless ``ttl_s`` is ``None`` or a positive finite number of seconds."""
    if ttl_s is None:
        return
    is_number = isinstance(ttl_s, int | float) and not isinstance(ttl_s, bool)
    if not is_number or not 0 < ttl_s < float("inf"):
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")


def validate_size_limit(size_limit_bytes: int) -> None:
    """Raise ``ValueError`` unless ``size_limit_bytes`` is a positive integer."""
    if isinstance(size_limit_bytes, bool) or not isinstance(size_limit_bytes, int):
        raise ValueError(f"size_limit_bytes must be an int, got {size_limit_bytes!r}")
    if size_limit_bytes <= 0:
        raise ValueError(f"size_limit_bytes must be positive, got {size_limit_bytes!r}")
