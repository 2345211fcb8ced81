"""The checksummed envelope around every persisted cache value (DiskStore, RedisStore).

Layout: 4-byte magic, expiry time as a little-endian double (store-clock seconds, 0.0 = never),
a 16-byte BLAKE2b digest over (key, expiry, payload), then the payload. A damaged, truncated or
foreign value fails ``unpack`` and is treated as a miss. Knows nothing about where bytes live.
"""

from __future__ import annotations

import hashlib
import struct

__all__ = ["HEADER_SIZE", "pack", "unpack"]

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
