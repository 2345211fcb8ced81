"""Chunk KV store: the KV of document chunks computed on their own, for reuse in any order.

A chunk's KV is computed alone at positions ``[0, n)`` (after nothing: no head, no BOS), so it
depends only on the chunk's token ids and the model; the caller re-rotates its keys to wherever
the chunk lands in a prompt (``runtime.chunks.rotation``). Entries are keyed by (namespace, sha256
of the token ids), stored in whole blocks of their own ``KVPool`` under a byte budget, and evicted
by ``runtime.cache.eviction`` (the prefix cache's policies; an entry's "branches" are the
requests that used it, so with ``"shared"`` often-used chunks outlive one-off ones). With a disk
tier (the prefix cache's, ``serve --kv-disk-dir``) an evicted chunk spills there block by block and
a lookup that misses memory loads it back, so chunks outlive the memory budget and restarts. It
knows token ids and tensors, never models, positions, requests or threads (the engine's lock
guards it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NewType

import torch

from runtime.cache.disk_tier import DiskTier
from runtime.cache.eviction import EvictionHeap, EvictionPolicy
from runtime.cache.kv_pool import KVPool
from runtime.cache.radix_cache import BlockHash, Namespace
from runtime.cache.records import ChunkStoreStats

__all__ = ["ChunkKey", "ChunkStore", "ChunkStoreStats", "chunk_key"]

ChunkKey = NewType("ChunkKey", bytes)
"""sha256 over (version tag, namespace, token ids as little-endian int64)."""

_KEY_VERSION = b"agentcache-chunk-v1\0"
_DISK_TAG = b"agentcache-chunk-block-v1\0"
"""Prefix of a chunk block's disk-tier hash, so it never equals a prefix-cache block's."""


def chunk_key(namespace: Namespace, tokens: Sequence[int]) -> ChunkKey:
    """The store key of a chunk: fixed and reproducible (sha256, version-tagged)."""
    ids = array("q", tokens)
    assert ids.itemsize == 8, "chunk keys need 8-byte int64 arrays"
    digest = hashlib.sha256(_KEY_VERSION + namespace.encode() + b"\0" + ids.tobytes())
    return ChunkKey(digest.digest())


class _Root:
    """The one parent of every entry: entries are leaves of a flat 'tree' for ``EvictionHeap``."""

    children: dict[Any, Any] = {}


_ROOT = _Root()
_NO_CHILDREN: dict[Any, Any] = {}


@dataclass(slots=True, eq=False)
class _Entry:
    """One stored chunk: ``num_tokens`` positions of KV in ``block_ids`` (token order)."""

    key: ChunkKey
    num_tokens: int
    block_ids: list[int]
    namespace: Namespace
    num_branches: int = 1
    """Requests that used this chunk (the ``"shared"`` eviction policy's sharing count)."""
    last_access: int = 0
    priority: int = 0
    heap_seq: int = -1
    ref_count: int = 0
    """Always 0: an entry is copied out under the engine lock, never held across calls."""

    @property
    def parent(self) -> _Root:
        return _ROOT

    @property
    def children(self) -> dict[Any, Any]:
        return _NO_CHILDREN


class ChunkStore:
    """Chunk KV under a byte budget: ``get`` copies an entry out, ``put`` stores one.

    Args:
        pool: Block storage of this store alone (its ``budget_bytes`` is the store's budget).
        policy: ``"shared"`` or ``"lru"`` (``runtime.cache.eviction``); the adaptive policies
            need a radix tree's virtual caches, which this flat store has not, and ``"slru"``
            its branch counts.

    Raises:
        ValueError: another policy.
    """

    def __init__(self, pool: KVPool, *, policy: EvictionPolicy = "shared") -> None:
        if policy not in ("shared", "lru"):
            raise ValueError(
                f"the chunk store's eviction policy is 'shared' or 'lru', not {policy!r}"
            )
        self.pool = pool
        self._entries: dict[ChunkKey, _Entry] = {}
        self._heap: EvictionHeap[_Entry] = EvictionHeap(policy)
        self._tick = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        """Entries evicted to make room."""
        self.num_disk_hits = 0
        """Lookups served by loading the chunk back from ``disk``."""
        self.disk: DiskTier | None = None
        """Evicted chunks spill here and memory misses look here (set by ``KVStores``)."""
        self.write_through = False
        """Spill each chunk to ``disk`` as soon as it is stored, not only when evicted."""

    @property
    def num_entries(self) -> int:
        """Chunks stored now."""
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        """Bytes of the blocks holding stored chunks."""
        return (self.pool.num_blocks - self.pool.num_free) * self.pool.block_bytes

    def snapshot(self) -> ChunkStoreStats:
        """The counters and occupancy now (the caller holds the engine lock)."""
        return ChunkStoreStats(
            num_entries=len(self._entries), bytes_used=self.bytes_used,
            bytes_total=self.pool.bytes_total, num_hits=self.num_hits,
            num_misses=self.num_misses, num_evictions=self.num_evictions,
            num_disk_hits=self.num_disk_hits,
        )  # fmt: skip

    def get(self, namespace: Namespace, tokens: Sequence[int]) -> torch.Tensor | None:
        """A copy of a stored chunk's KV, or None (a miss).

        Returns:
            ``[L, 2, H_kv, len(tokens), D]`` KV computed at positions ``[0, len(tokens))``.

        Side effects: counts a hit or miss; a hit bumps the entry's eviction rank; a chunk
        found on the disk tier is loaded back into memory (counted in ``num_disk_hits``).
        """
        key = chunk_key(namespace, tokens)
        entry = self._entries.get(key)
        if entry is None:
            kv = self._load_from_disk(key, len(tokens))
            if kv is None:
                self.num_misses += 1
                return None
            self.num_hits += 1
            self.num_disk_hits += 1
            self._store(namespace, key, kv)
            return kv
        self.num_hits += 1
        entry.num_branches += 1
        self._touch(entry)
        padded = len(entry.block_ids) * self.pool.block_size
        l_, two, h, _, d = self.pool.block_shape
        out = torch.empty((l_, two, h, padded, d), dtype=self.pool.data.dtype,
                          device=self.pool.data.device)  # fmt: skip
        self.pool.read_into(entry.block_ids, out)
        return out[:, :, :, : entry.num_tokens]

    def put(self, namespace: Namespace, tokens: Sequence[int], kv: torch.Tensor) -> bool:
        """Store a chunk's KV (computed alone at positions ``[0, n)``), evicting others as needed.

        Args:
            tokens: The chunk's token ids (``n`` of them).
            kv: ``[L, 2, H_kv, n, D]`` KV of those tokens.

        Returns:
            True when stored (or already there); False when it cannot fit the whole budget.
        """
        assert kv.shape[3] == len(tokens) > 0, "one KV position per chunk token"
        return self._store(namespace, chunk_key(namespace, tokens), kv)

    def _store(self, namespace: Namespace, key: ChunkKey, kv: torch.Tensor) -> bool:
        """``put`` by key: ``kv`` is ``[L, 2, H_kv, n, D]``."""
        if key in self._entries:
            return True
        bs, num_tokens = self.pool.block_size, kv.shape[3]
        num_blocks = -(-num_tokens // bs)
        if num_blocks > self.pool.num_blocks:
            return False
        while not self.pool.can_allocate(num_blocks):
            self._evict_one()
        block_ids = self.pool.allocate(num_blocks)
        assert block_ids is not None, "allocate after making room"
        pad = num_blocks * bs - num_tokens
        if pad:
            zeros = kv.new_zeros((*kv.shape[:3], pad, kv.shape[4]))
            kv = torch.cat((kv, zeros), dim=3)
        self.pool.write_from(block_ids, kv)
        entry = _Entry(key, num_tokens, block_ids, namespace)
        self._entries[key] = entry
        self._touch(entry)
        if self.write_through:
            self._spill(entry)
        return True

    def flush(self, *, spill: bool = True) -> int:
        """Drop every entry (spilling each to the disk tier unless not ``spill``, as the prefix
        cache's flush does); returns how many were dropped."""
        num = len(self._entries)
        for entry in self._entries.values():
            if spill:
                self._spill(entry)
            self.pool.free(entry.block_ids)
            entry.heap_seq = -1
        self._entries.clear()
        self._heap.compact(0)
        return num

    def flush_namespace(self, namespace: Namespace) -> int:
        """Drop one namespace's entries and their blocks on the disk tier; returns entries
        dropped (other namespaces keep theirs)."""
        dropped = [e for e in self._entries.values() if e.namespace == namespace]
        for entry in dropped:
            del self._entries[entry.key]
            self.pool.free(entry.block_ids)
            entry.heap_seq = -1
        self._heap.compact(len(self._entries))
        if self.disk is not None:
            self.disk.remove_group(self.disk.group_of(namespace))
        return len(dropped)

    def check_integrity(self) -> None:
        """Assert free + stored blocks == total, blocks owned once, one live heap entry each."""
        self.pool.check_integrity()
        owned = [bid for e in self._entries.values() for bid in e.block_ids]
        assert len(owned) == len(set(owned)), "a block belongs to two chunks"
        assert self.pool.num_free + len(owned) == self.pool.num_blocks, (
            f"free {self.pool.num_free} + stored {len(owned)} != total {self.pool.num_blocks}"
        )
        bs = self.pool.block_size
        for entry in self._entries.values():
            assert len(entry.block_ids) == -(-entry.num_tokens // bs), "entry block count"
        assert self._heap.num_live() == len(self._entries), "eviction heap drifted"

    def _touch(self, entry: _Entry) -> None:
        self._tick += 1
        self._heap.touch(entry, self._tick)
        self._heap.update(entry)
        self._heap.compact(len(self._entries))

    def _evict_one(self) -> None:
        entry = self._heap.pop()
        assert entry is not None, "a full pool with nothing evictable"
        del self._entries[entry.key]
        self._spill(entry)
        self.pool.free(entry.block_ids)
        self.num_evictions += 1

    def _disk_keys(self, key: ChunkKey, num_tokens: int) -> list[str]:
        """The disk tier's file keys of a chunk's blocks, in token order."""
        assert self.disk is not None
        count = -(-num_tokens // self.pool.block_size)
        return [self.disk.key(BlockHash(hashlib.sha256(_DISK_TAG + key + i.to_bytes(4, "little"))
                                        .digest())) for i in range(count)]  # fmt: skip

    def _spill(self, entry: _Entry) -> None:
        """Queue an entry's blocks for the disk tier (a copy each; a full queue drops them)."""
        if self.disk is None:
            return
        group = self.disk.group_of(entry.namespace)
        keys = self._disk_keys(entry.key, entry.num_tokens)
        for i, (block_id, disk_key) in enumerate(zip(entry.block_ids, keys, strict=True)):
            read = partial(self.pool.read_block, block_id)
            self.disk.offer(disk_key, read, group=group, depth=i)

    def _load_from_disk(self, key: ChunkKey, num_tokens: int) -> torch.Tensor | None:
        """``[L, 2, H_kv, num_tokens, D]`` KV of a spilled chunk, or None unless every one of its
        blocks is on the disk tier and intact."""
        if self.disk is None:
            return None
        keys = self._disk_keys(key, num_tokens)
        if not all(self.disk.contains(k) for k in keys):
            return None
        blocks = [self.disk.load(k) for k in keys]
        if any(b is None for b in blocks):
            return None
        kv = torch.cat([b for b in blocks if b is not None], dim=3)  # [L, 2, H_kv, padded, D]
        return kv[:, :, :, :num_tokens].to(self.pool.data.device)
