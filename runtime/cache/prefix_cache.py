"""Prefix cache: the one place that talks to both the radix tree (tokens) and the KV pool (tensors).

``match`` copies the longest cached prefix into a request's buffer; ``insert`` stores the
request's whole blocks. With a disk tier, new blocks are queued for disk as they are cached
(``"write-through"``) or when evicted (``"evict"``), and a match continues past the tree into
it, loading blocks back into the pool. It knows nothing about the model,
sampling or threads (the engine holds its lock around every call).
"""

from __future__ import annotations

import hashlib
import time
from functools import partial
from typing import NamedTuple, Protocol

import torch

from runtime.cache.disk_tier import DiskPolicy, DiskTier
from runtime.cache.eviction import EvictionPolicy
from runtime.cache.kv_pool import KVPool
from runtime.cache.radix_cache import (
    BlockHash,
    EvictedBlock,
    MatchResult,
    Namespace,
    RadixCache,
    TreeNode,
    block_hash,
)

__all__ = ["KVBuffer", "PrefixCache", "PrefixHit", "namespace_of"]


class KVBuffer(Protocol):
    """A live request's KV buffer as the prefix cache sees it (``model.kv_cache`` implements it).

    Defined here, not imported, so the cache layer never depends on the engine layer above it.
    """

    length: int
    """Valid positions ``[0, length)``."""

    def reserve(self, total_len: int) -> None:
        """Make room for ``total_len`` positions (may reallocate)."""

    def span(self, start: int, end: int) -> torch.Tensor:
        """``[L, 2, H_kv, end - start, D]`` view of positions ``[start, end)`` (no copy)."""


# NOTE: fixed, documented key function: sha256 over NUL-separated fields, version-tagged.
_KEY_VERSION = "agentcache-prefix-v1"


def namespace_of(
    model_id: str, revision: str | None, dtype: str, cache_salt: str | None
) -> Namespace:
    """Namespace of a request: model id, revision, dtype and tenant salt, hashed (sha256 hex)."""
    fields = (_KEY_VERSION, model_id, revision or "", dtype, cache_salt or "")
    return Namespace(hashlib.sha256("\0".join(fields).encode()).hexdigest())


class PrefixHit(NamedTuple):
    """Result of ``PrefixCache.match``: ``cached_len`` positions now in the buffer; pin ``node``."""

    cached_len: int
    node: TreeNode | None
    block_ids: tuple[int, ...] = ()
    """The pool blocks copied into the buffer, in order (they cover at least ``cached_len``
    positions; pinned with ``node``, so their bytes do not change until it is released)."""


class PrefixCache:
    """Radix tree + KV pool (+ optional disk tier) with hit counters per tier.

    Every node returned by ``match``/``insert`` is locked for the caller, who must pass it to
    ``release`` exactly once (finish, stop, error or cancel).
    """

    def __init__(
        self,
        pool: KVPool,
        *,
        is_enabled: bool,
        disabled_reason: str | None,
        policy: EvictionPolicy = "adaptive",
        disk: DiskTier | None = None,
        disk_policy: DiskPolicy = "write-through",
    ) -> None:
        self.pool = pool
        self.radix = RadixCache(pool.block_size, policy=policy, capacity_blocks=pool.num_blocks)
        self.is_enabled = is_enabled and pool.num_blocks > 0
        self.disabled_reason = disabled_reason
        if is_enabled and pool.num_blocks == 0:
            self.disabled_reason = "kv_cache_bytes is smaller than one block"
        self.disk = disk if self.is_enabled else None
        self.disk_policy: DiskPolicy = disk_policy
        """When blocks reach ``disk``: as cached (``"write-through"``) or when evicted."""
        self.queried_tokens = 0
        self.hit_tokens = 0
        """Prompt tokens served from either tier."""
        self.disk_hit_tokens = 0
        """Prompt tokens of ``hit_tokens`` whose blocks were loaded back from the disk tier."""
        self.num_evictions = 0

    def match(
        self, namespace: Namespace, tokens: list[int], kv: KVBuffer, *, use_cache: bool
    ) -> PrefixHit:
        """Copy the longest cached prefix of ``tokens`` into ``kv`` (positions ``[0, cached_len)``).

        At most ``len(tokens) - 1`` positions are served: the last prompt token is always
        recomputed so the first sampled token has logits. Counts the query in the hit stats.
        Side effects: bumps LRU, may split a node, locks the returned node; with a disk tier,
        blocks found there are loaded into the pool and the tree (evicting others to make room).
        """
        self.queried_tokens += len(tokens)
        if not (use_cache and self.is_enabled and tokens):
            return PrefixHit(0, None)
        found = self.radix.match(namespace, tokens, is_request=True)
        self.radix.lock(found.node)
        from_memory = min(found.cached_len, len(tokens) - 1)
        if self.disk is not None:
            found = self._load_from_disk(namespace, tokens, found)
        cached_len = min(found.cached_len, len(tokens) - 1)
        if found.cached_len:
            # NOTE: copy whole blocks, trust only cached_len positions (the last may be redone).
            kv.reserve(found.cached_len)
            self.pool.read_into(found.block_ids, kv.span(0, found.cached_len))
        kv.length = cached_len
        self.hit_tokens += cached_len
        self.disk_hit_tokens += cached_len - from_memory
        return PrefixHit(cached_len, found.node, tuple(found.block_ids))

    def peek(self, namespace: Namespace, tokens: list[int], *, use_cache: bool) -> int:
        """Prompt positions ``match`` would serve now (read-only: no LRU bump, no split).

        Counts blocks on the disk tier too, and asks it to prefetch them in the background.
        """
        if not (use_cache and self.is_enabled):
            return 0
        cached_len, last = self.radix.peek(namespace, tokens)
        if self.disk is not None:
            keys = self._disk_run(last, tokens, cached_len)
            self.disk.prefetch(keys)
            cached_len += len(keys) * self.pool.block_size
        return min(cached_len, len(tokens) - 1)

    def insert(
        self, namespace: Namespace, tokens: list[int], kv: KVBuffer, held: TreeNode | None
    ) -> TreeNode | None:
        """Store the whole blocks of ``tokens`` (KV from ``kv``), evicting blocks if needed.

        Args:
            tokens: token ids whose KV is in ``kv`` positions ``[0, len(tokens))``.
            held: the node the caller has locked (or None); its lock moves to the returned node.

        Returns:
            The node now locked for the caller (``held`` when nothing could be added).
        """
        if held is None or not self.is_enabled:
            return held
        bs = self.pool.block_size
        num_full = min(len(tokens), kv.length) // bs
        found = self.radix.match(namespace, tokens[: num_full * bs])
        num_new = num_full - found.cached_len // bs
        if num_new <= 0:
            return held
        self.radix.lock(found.node)
        new_ids = self._allocate(num_new)
        self.radix.unlock(found.node)
        if not new_ids:
            return held
        end = found.cached_len + len(new_ids) * bs
        self.pool.write_from(new_ids, kv.span(found.cached_len, end))
        node, _ = self.radix.insert(namespace, tokens[:end], found.block_ids + new_ids)
        self.radix.lock(node)
        self.radix.unlock(held)
        if self.disk is not None:
            # NOTE: the new node holds exactly the new blocks (found.node was pinned meanwhile).
            assert node.block_ids[-len(new_ids) :] == new_ids, "new blocks end the node"
            hashes = node.hashes[-len(new_ids) :]
            self.disk.mark_resident(map(self.disk.key, hashes), is_resident=True)
            if self.disk_policy == "write-through":
                self._write(namespace, new_ids, hashes, found.cached_len // bs)
        return node

    def acquire(self, node: TreeNode | None) -> TreeNode | None:
        """Pin ``node`` once more for another holder (the choices of one prompt share its node).

        Returns:
            ``node``, which that holder must ``release`` exactly once (None is a no-op).
        """
        if node is not None:
            self.radix.lock(node)
        return node

    def release(self, node: TreeNode | None) -> None:
        """Unpin a node returned by ``match``/``insert``/``acquire`` (None is a no-op)."""
        if node is not None:
            self.radix.unlock(node)

    def flush(self, *, include_disk: bool = False) -> int:
        """Evict every unpinned block; returns how many were freed (pinned ones stay).

        Evicted blocks spill to the disk tier as any eviction does, unless ``include_disk``,
        which also removes every block file.
        """
        evicted = self.radix.evict_all()
        if self.disk is not None and not include_disk:
            self._spill(evicted)
        self.pool.free([e.block_id for e in evicted])
        if self.disk is not None and include_disk:
            keys = [self.disk.key(e.block_hash) for e in evicted]
            self.disk.mark_resident(keys, is_resident=False)
            self.disk.drain()
            self.disk.clear()
        return len(evicted)

    def flush_namespace(self, namespace: Namespace) -> int:
        """Drop one namespace's unpinned blocks, and all its blocks on the disk tier (queued
        writes included); other namespaces keep theirs. Returns the pool blocks freed."""
        evicted = self.radix.evict_namespace(namespace)
        self.pool.free([e.block_id for e in evicted])
        if self.disk is not None:
            keys = [self.disk.key(e.block_hash) for e in evicted]
            self.disk.mark_resident(keys, is_resident=False)
            self.disk.remove_group(self.disk.group_of(namespace))
        return len(evicted)

    def persist(self, timeout_s: float) -> int:
        """Offer every block in memory to the disk tier (a graceful shutdown), shallow blocks
        first so each chain is kept from its start; those already on disk become its most
        recently used files. Waits for queue room until ``timeout_s`` has passed, then stops.

        Returns:
            Blocks newly queued or bumped (0 without a disk tier).
        """
        if self.disk is None:
            return 0
        deadline = time.monotonic() + timeout_s
        num = 0
        for node, depth in self.radix.nodes_by_depth():
            group = self.disk.group_of(node.namespace)
            for i, (bid, h) in enumerate(zip(node.block_ids, node.hashes, strict=True)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return num
                read = partial(self.pool.read_block, bid)
                num += self.disk.offer(self.disk.key(h), read, group=group, depth=depth + i,
                                       wait_s=left)  # fmt: skip
        return num

    def check_integrity(self) -> None:
        """Assert free + evictable + in-use == total blocks, and every part's own invariants.

        With a disk tier, also that its index matches its directory within the byte budget.
        """
        self.pool.check_integrity()
        self.radix.check_integrity()
        free, radix = self.pool.num_free, self.radix
        total = free + radix.num_evictable_blocks + radix.num_in_use_blocks
        assert total == self.pool.num_blocks, (
            f"free {free} + evictable {radix.num_evictable_blocks} + in-use "
            f"{radix.num_in_use_blocks} != total {self.pool.num_blocks}"
        )
        assert 0 <= self.disk_hit_tokens <= self.hit_tokens <= self.queried_tokens, "hit counts"
        if self.disk is not None:
            self.disk.check_integrity()

    def _allocate(self, num_blocks: int) -> list[int]:
        """Up to ``num_blocks`` pool blocks, evicting (and spilling) unpinned ones as needed."""
        missing = num_blocks - self.pool.num_free
        if missing > 0:
            evicted = self.radix.evict(missing)
            if self.disk is not None:
                self._spill(evicted)
            self.pool.free([e.block_id for e in evicted])
            self.num_evictions += len(evicted)
        return self.pool.allocate(min(num_blocks, self.pool.num_free)) or []

    def _spill(self, evicted: list[EvictedBlock]) -> None:
        """Queue evicted blocks for the disk tier (a copy each unless on disk or queued already;
        a full queue drops them). Under write-through most are there already."""
        assert self.disk is not None
        self.disk.mark_resident([self.disk.key(e.block_hash) for e in evicted], is_resident=False)
        for e in evicted:
            self._write(e.namespace, [e.block_id], [e.block_hash], e.depth)

    def _write(
        self, namespace: Namespace, block_ids: list[int], hashes: list[BlockHash], depth: int
    ) -> None:
        """Offer pool blocks (the first at chain position ``depth``) to the disk tier,
        deduplicated by hash (never blocks on IO)."""
        disk = self.disk
        assert disk is not None
        group = disk.group_of(namespace)
        for i, (bid, h) in enumerate(zip(block_ids, hashes, strict=True)):
            read = partial(self.pool.read_block, bid)
            disk.offer(disk.key(h), read, group=group, depth=depth + i)

    def _disk_run(self, last: BlockHash, tokens: list[int], pos: int) -> list[str]:
        """Keys of the consecutive blocks of ``tokens[pos:]`` present on the disk tier."""
        assert self.disk is not None
        bs, keys = self.pool.block_size, []
        while pos + bs <= len(tokens):
            last = block_hash(last, tokens[pos : pos + bs])
            key = self.disk.key(last)
            if not self.disk.contains(key):
                break
            keys.append(key)
            pos += bs
        return keys

    def _load_from_disk(
        self, namespace: Namespace, tokens: list[int], found: MatchResult
    ) -> MatchResult:
        """Extend a locked tree match with blocks from disk; the result's node is locked instead.

        Stops at the first block that is absent or damaged; loads only what the pool can hold.
        """
        assert self.disk is not None
        bs = self.pool.block_size
        keys = self._disk_run(self.radix.chain_start(found.node), tokens, found.cached_len)
        blocks = []
        for key in keys:
            block = self.disk.load(key)
            if block is None:
                break
            blocks.append(block)
        new_ids = self._allocate(len(blocks)) if blocks else []
        if not new_ids:
            return found
        for bid, block in zip(new_ids, blocks, strict=False):
            self.pool.write_block(bid, block)
        self.disk.mark_resident(keys[: len(new_ids)], is_resident=True)
        end = found.cached_len + len(new_ids) * bs
        node, _ = self.radix.insert(namespace, tokens[:end], found.block_ids + new_ids)
        self.radix.lock(node)
        self.radix.unlock(found.node)
        return MatchResult(end, node, found.block_ids + new_ids)
