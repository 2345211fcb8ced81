"""Prefix cache: the one place that talks to both the radix tree (tokens) and the KV pool (tensors).

``match`` copies the longest cached prefix into a request's buffer; ``insert`` stores the
request's whole blocks. It knows nothing about the model, sampling or threads (the engine holds
its lock around every call).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Protocol

import torch

from runtime.cache.eviction import EvictionPolicy
from runtime.cache.kv_pool import KVPool
from runtime.cache.radix_cache import Namespace, RadixCache, TreeNode

__all__ = ["KVBuffer", "PrefixCache", "PrefixHit", "namespace_of"]


class KVBuffer(Protocol):
    """A live request's KV buffer as the prefix cache sees it (``runtime.kv_cache`` implements it).

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


class PrefixCache:
    """Radix tree + KV pool with hit counters.

    Every node returned by ``match``/``insert`` is locked for the caller, who must pass it to
    ``release`` exactly once (finish, stop, error or cancel).
    """

    def __init__(
        self,
        pool: KVPool,
        *,
        is_enabled: bool,
        disabled_reason: str | None,
        policy: EvictionPolicy = "shared",
    ) -> None:
        self.pool = pool
        self.radix = RadixCache(pool.block_size, policy=policy)
        self.is_enabled = is_enabled and pool.num_blocks > 0
        self.disabled_reason = disabled_reason
        if is_enabled and pool.num_blocks == 0:
            self.disabled_reason = "kv_cache_bytes is smaller than one block"
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.num_evictions = 0

    def match(
        self, namespace: Namespace, tokens: list[int], kv: KVBuffer, *, use_cache: bool
    ) -> PrefixHit:
        """Copy the longest cached prefix of ``tokens`` into ``kv`` (positions ``[0, cached_len)``).

        At most ``len(tokens) - 1`` positions are served: the last prompt token is always
        recomputed so the first sampled token has logits. Counts the query in the hit stats.
        Side effects: bumps LRU, may split a node, locks the returned node.
        """
        self.queried_tokens += len(tokens)
        if not (use_cache and self.is_enabled):
            return PrefixHit(0, None)
        found = self.radix.match(namespace, tokens)
        self.radix.lock(found.node)
        cached_len = min(found.cached_len, len(tokens) - 1)
        if found.cached_len:
            # NOTE: copy whole blocks, trust only cached_len positions (the last may be redone).
            kv.reserve(found.cached_len)
            self.pool.read_into(found.block_ids, kv.span(0, found.cached_len))
        kv.length = cached_len
        self.hit_tokens += cached_len
        return PrefixHit(cached_len, found.node)

    def peek(self, namespace: Namespace, tokens: list[int], *, use_cache: bool) -> int:
        """Prompt positions ``match`` would serve now (read-only: no LRU bump, no split)."""
        if not (use_cache and self.is_enabled):
            return 0
        return min(self.radix.peek(namespace, tokens)[0], len(tokens) - 1)

    def insert(
        self, namespace: Namespace, tokens: list[int], kv: KVBuffer, held: TreeNode | None
    ) -> TreeNode | None:
        """Store the whole blocks of ``tokens`` (KV from ``kv``), evicting LRU leaves if needed.

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
        self._make_room(num_new)
        new_ids = self.pool.allocate(min(num_new, self.pool.num_free)) or []
        self.radix.unlock(found.node)
        if not new_ids:
            return held
        end = found.cached_len + len(new_ids) * bs
        self.pool.write_from(new_ids, kv.span(found.cached_len, end))
        node, _ = self.radix.insert(namespace, tokens[:end], found.block_ids + new_ids)
        self.radix.lock(node)
        self.radix.unlock(held)
        return node

    def release(self, node: TreeNode | None) -> None:
        """Unpin a node returned by ``match``/``insert`` (None is a no-op)."""
        if node is not None:
            self.radix.unlock(node)

    def flush(self) -> int:
        """Evict every unpinned block; returns how many were freed (pinned ones stay)."""
        freed = [e.block_id for e in self.radix.evict(self.radix.num_blocks)]
        self.pool.free(freed)
        return len(freed)

    def check_integrity(self) -> None:
        """Assert free + evictable + in-use == total blocks, and both parts' own invariants."""
        self.pool.check_integrity()
        self.radix.check_integrity()
        free, radix = self.pool.num_free, self.radix
        total = free + radix.num_evictable_blocks + radix.num_in_use_blocks
        assert total == self.pool.num_blocks, (
            f"free {free} + evictable {radix.num_evictable_blocks} + in-use "
            f"{radix.num_in_use_blocks} != total {self.pool.num_blocks}"
        )

    def _make_room(self, num_blocks: int) -> None:
        missing = num_blocks - self.pool.num_free
        if missing > 0:
            freed = [e.block_id for e in self.radix.evict(missing)]
            self.pool.free(freed)
            self.num_evictions += len(freed)
