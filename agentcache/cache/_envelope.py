"""The checksummed envelope around every persisted cache value (DiskStore, RedisStore).

Layout: 4-byte magic, expiry time as a little-endian double (store-clock seconds, 0.0 = never),
a 16-byte BLAKE2b digest over (key, expiry, payload), then the payload. A damaged, truncated or
foreign value fails ``unpack`` and is treated as a miss (``open_envelope``: the one rule both
stores apply on a read). Knows nothing about where bytes live.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from collections.abc import Callable

from agentcache.cache.base import CacheRecoveryWarning, Clock

__all__ = ["HEADER_SIZE", "open_envelope", "pack", "unpack"]

_MAGIC = b"AC1\x00"
_HEADER = struct.Struct("<4sd16s")  # magic, expire_at in clock seconds (0.0 = never), checksum
HEADER_SIZE = _HEADER.size
"""Bytes the envelope adds in front of the payload."""


def _checksum(key: str, expire_at: float, payload: bytes) -> bytes:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16)
    digest.update(struct.pack("<d", expire_at))
    digest.update(payload)
    return digest.digest()


def pack(key: str, expire_at: float, payload: bytes) -> bytes:
    """Envelope of ``payload`` stored under ``key``, expiring at ``expire_at`` (0.0 = never)."""
    return _HEADER.pack(_MAGIC, expire_at, _checksum(key, expire_at, payload)) + payload


def unpack(key: str, raw: object) -> tuple[bytes, float] | None:
    """(payload, expire_at) of a well-formed envelope whose checksum matches, else ``None``."""
    if not isinstance(raw, bytes) or len(raw) < _HEADER.size:
        return None
    magic, expire_at, digest = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size :]
    if magic != _MAGIC or digest != _checksum(key, expire_at, payload):
        return None
    return payload, expire_at


def open_envelope(
    key: str, raw: object, *, clock: Clock, drop: Callable[[str], object]
) -> bytes | None:
    """The payload of the envelope ``raw`` read under ``key``, or ``None`` (a miss).

    A damaged or foreign envelope is dropped (``drop(key)``) with a ``CacheRecoveryWarning``
    (NOTE: ``stacklevel`` assumes the store's private ``_open`` called this from a public read,
    so the warning points at that read's caller); one expired by ``clock`` is dropped quietly.
    """
    verified = unpack(key, raw)
    if verified is None:
        drop(key)
        warnings.warn(
            f"cache entry {key[:16]}… failed its checksum; dropped it",
            CacheRecoveryWarning,
            stacklevel=4,
        )
        return None
    payload, expire_at = verified
    if expire_at and expire_at <= clock():
        drop(key)
        return None
    return payload
