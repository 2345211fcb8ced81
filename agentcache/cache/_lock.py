"""Cross-process single-flight on Redis: one fenced lease per missing key.

Keys under the store's prefix ``P``: ``P:lock:<key>`` holds the live lease's token and expires after
the lock expiry (so a crashed holder frees its key); ``P:owner:<key>`` holds the newest token ever
handed out for the key and lives much longer, so a holder whose lock expired is told apart from the
one that took over (fencing: its write is refused); ``P:fence`` is the counter tokens come from.
Each step is one Lua script, atomic on the server. Knows nothing about envelopes or results.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import redis

__all__ = ["LeaseScripts", "RedisLease", "Guarded"]

T = TypeVar("T")

_OWNER_MIN_MS = 24 * 3600 * 1000  # NOTE: a holder slower than this loses its write, never wins

# KEYS: value, lock, owner, fence. ARGV: lock ms, owner ms. -> {1, value} | {0, ""} | {2, token}
_CLAIM = """
local value = redis.call('GET', KEYS[1])
if value then return {1, value} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, ''} end
local token = redis.call('INCR', KEYS[4])
redis.call('SET', KEYS[2], token, 'PX', ARGV[1])
redis.call('SET', KEYS[3], token, 'PX', ARGV[2])
return {2, token}
"""

# KEYS: value, lock, owner. ARGV: token, envelope, ttl ms (0 = none). -> 1 stored | 0 fenced out
_COMMIT = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return 0 end
if ARGV[3] == '0' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
redis.call('DEL', KEYS[2], KEYS[3])
return 1
"""

# KEYS: lock, owner. ARGV: token. -> 1 released | 0 someone newer holds the key
_RELEASE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


class Guarded(Protocol):
    """The store's error boundary: run ``op`` on the client, or ``default`` if Redis fails."""

    def guarded(self, op: Callable[[redis.Redis], T], default: T) -> T: ...


class LeaseScripts:
    """The three Lua scripts of a lease, bound to one key prefix.

    Args:
        client: redis-py client; scripts are re-sent by redis-py after a server restart.
        prefix: Key prefix of the store (``"<namespace>"``).
        lock_ttl_s: Lock expiry, seconds: the longest a crashed holder delays its key.
    """

    def __init__(self, client: redis.Redis, prefix: str, *, lock_ttl_s: float) -> None:
        self.prefix = prefix
        self.lock_ms = max(1, round(lock_ttl_s * 1000))
        self._owner_ms = max(_OWNER_MIN_MS, 10 * self.lock_ms)
        self._claim = client.register_script(_CLAIM)
        self._commit = client.register_script(_COMMIT)
        self._release = client.register_script(_RELEASE)

    def value_key(self, key: str) -> str:
        """Redis key of ``key``'s value."""
        return f"{self.prefix}:v:{key}"

    def _lease_keys(self, key: str) -> list[str]:
        return [f"{self.prefix}:lock:{key}", f"{self.prefix}:owner:{key}"]

    def attempt(self, client: redis.Redis, key: str) -> bytes | int:
        """One claim attempt: the stored envelope (bytes), 0 while another lease is live, or a
        new token (> 0) when this caller now holds the lease."""
        keys = [self.value_key(key), *self._lease_keys(key), f"{self.prefix}:fence"]
        kind, payload = self._claim(keys=keys, args=[self.lock_ms, self._owner_ms], client=client)
        if kind == 1:
            assert isinstance(payload, bytes), "claim script returns the value as bytes"
            return payload
        return int(payload) if kind == 2 else 0

    def commit(self, client: redis.Redis, key: str, token: int, envelope: bytes, px: int) -> bool:
        """Store ``envelope`` (ttl ``px`` ms, 0 = none) iff ``token`` is the key's newest lease."""
        keys = [self.value_key(key), *self._lease_keys(key)]
        return bool(self._commit(keys=keys, args=[token, envelope, px], client=client))

    def release(self, client: redis.Redis, key: str, token: int) -> None:
        """Drop the lease iff ``token`` is still the key's newest one."""
        self._release(keys=self._lease_keys(key), args=[token], client=client)


class RedisLease:
    """A held lease (see ``FlightLease``); settled once, by ``commit`` or ``release``.

    Args:
        store: The store's error boundary (an unreachable server refuses the commit quietly).
        scripts: The lease scripts.
        key: The cache key.
        token: This lease's fencing token.
        pack: Builds ``(envelope, ttl ms)`` for a value, or ``None`` if it is over the budget.
    """

    def __init__(
        self,
        store: Guarded,
        scripts: LeaseScripts,
        key: str,
        token: int,
        pack: Callable[[str, bytes, float | None], tuple[bytes, int] | None],
    ) -> None:
        self.token = token
        self.key = key
        self._store = store
        self._scripts = scripts
        self._pack = pack
        self._is_settled = False
        self.acquired_at = time.monotonic()

    def commit(self, value: bytes, *, ttl_s: float | None) -> bool:
        """See ``FlightLease.commit``."""
        if self._is_settled:
            return False
        packed = self._pack(self.key, value, ttl_s)
        if packed is None:
            self.release()
            return False
        self._is_settled = True
        envelope, px = packed
        commit = self._scripts.commit
        return self._store.guarded(lambda c: commit(c, self.key, self.token, envelope, px), False)

    def release(self) -> None:
        """See ``FlightLease.release``."""
        if self._is_settled:
            return
        self._is_settled = True
        release = self._scripts.release
        self._store.guarded(lambda c: release(c, self.key, self.token), None)
