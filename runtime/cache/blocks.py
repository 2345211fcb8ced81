"""Names of cached blocks: namespaces, chained block hashes, and the record of an evicted block.

The hash function and seed are fixed and reproducible (sha256 over the parent hash and the block's
token ids as little-endian int64), so a block's name is the same in every process: the disk tier
keys its files with it. No torch, no tree.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple, NewType

__all__ = ["BlockHash", "EvictedBlock", "Namespace", "block_hash", "root_hash"]

Namespace = NewType("Namespace", str)
"""Hex digest of (model id, revision, dtype, cache_salt); see ``prefix_cache.namespace_of``."""
BlockHash = NewType("BlockHash", bytes)
"""sha256 digest naming one block: its parent block's hash chained with its own token ids."""


def root_hash(namespace: Namespace) -> BlockHash:
    """Hash the chain of a namespace starts from (sha256 of the namespace digest)."""
    return BlockHash(hashlib.sha256(b"agentcache-block-v1\0" + namespace.encode()).digest())


def block_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """sha256(parent hash || token ids as little-endian int64): fixed and reproducible."""
    ids = array("q", tokens)
    if ids.itemsize != 8 or array("q", [1]).tobytes()[0] != 1:  # pragma: no cover - exotic hosts
        raise RuntimeError("block hashes need 8-byte little-endian int64 arrays")
    return BlockHash(hashlib.sha256(parent + ids.tobytes()).digest())


class EvictedBlock(NamedTuple):
    """One block freed by ``RadixCache.evict``: pool id, chained hash, namespace, and depth (its
    position in the chain: 0 is a namespace's first block)."""

    block_id: int
    block_hash: BlockHash
    namespace: Namespace
    depth: int = 0
