"""KVStores: an engine's stored KV, built to its model's KV shape: prefix cache and chunk store.

The prefix cache (a block pool, optionally spilling to a disk tier) and the chunk store (document
chunks' KV, used only by requests with chunk reuse) each get a byte budget here; the disk tier's
fingerprint (weights + block layout) is fixed here. It does not lock (the engine's lock guards
every call but ``drain_disk``), and it knows neither requests nor the scheduler.
"""

from __future__ import annotations

import logging

from runtime.cache.chunk_store import ChunkStore
from runtime.cache.disk_tier import DiskTier
from runtime.cache.kv_pool import KVPool
from runtime.cache.prefix_cache import PrefixCache
from runtime.cache.radix_cache import Namespace
from runtime.config import EngineConfig
from runtime.model.runner import ModelRunner, reuse_blocker
from runtime.outputs import CacheStats

__all__ = ["KVStores"]

logger = logging.getLogger(__name__)


class KVStores:
    """The prefix cache (with its optional disk tier) and the chunk store of one model."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, *, model_id: str) -> None:
        """Allocate both pools (the budgets and policies of ``config``).

        Prefix reuse is off (force-miss, same code path) for ``prefix_cache=False`` and for a
        model whose cache cannot be resumed safely (``reuse_blocker``; logged as a warning);
        then no disk tier is opened either.

        Raises:
            OSError: ``kv_disk_dir`` cannot be created or read.
        """
        self.runner = runner
        self.model_id = model_id
        block_size = config.block_size
        self.prefix_cache = self._make_prefix_cache(config, block_size)
        if config.kv_disk_dir is not None and self.prefix_cache.is_enabled:
            self.prefix_cache.disk = self._make_disk_tier(config.kv_disk_dir, config.disk_bytes)
        self.prefix_cache.disk_policy = config.disk_policy
        pool = self._make_pool(config.chunk_cache_bytes, block_size)
        self.chunk_store = ChunkStore(pool, policy=config.chunk_eviction)
        """Document chunks' KV for requests that ask for chunk reuse (``runtime.chunks``); it
        spills to the prefix cache's disk tier too (chunk blocks have their own keys)."""
        self.chunk_store.disk = self.prefix_cache.disk
        self.chunk_store.write_through = config.disk_policy == "write-through"

    def stats(self) -> CacheStats:
        """Prefix cache counters and occupancy, with the disk tier's and the chunk store's."""
        pc = self.prefix_cache
        used, disk = pc.radix.num_blocks, pc.disk
        return CacheStats(
            queried_tokens=pc.queried_tokens,
            hit_tokens=pc.hit_tokens,
            disk_hit_tokens=pc.disk_hit_tokens,
            disk=None if disk is None else disk.snapshot(),
            bytes_used=used * pc.pool.block_bytes,
            bytes_total=pc.pool.bytes_total,
            num_blocks_used=used,
            num_blocks_total=pc.pool.num_blocks,
            num_evictions=pc.num_evictions,
            is_enabled=pc.is_enabled,
            disabled_reason=pc.disabled_reason,
            num_blocks_pinned=pc.radix.num_in_use_blocks,
            chunk_store=self.chunk_store.snapshot(),
        )

    def flush(self, *, include_disk: bool = False) -> int:
        """Drop every unpinned block of both stores; returns the prefix blocks freed.

        As ``PrefixCache.flush``: the dropped blocks (and chunks) spill to the disk tier unless
        ``include_disk``, which also deletes every block file.
        """
        self.chunk_store.flush(spill=not include_disk)
        return self.prefix_cache.flush(include_disk=include_disk)

    def flush_namespace(self, namespace: Namespace) -> int:
        """Drop one namespace's unpinned blocks and chunks, in memory and on the disk tier
        (``PrefixCache.flush_namespace``); returns the prefix blocks freed."""
        self.chunk_store.flush_namespace(namespace)
        return self.prefix_cache.flush_namespace(namespace)

    def drain_disk(self) -> None:
        """Wait until every queued disk-tier write is on disk (no-op without a disk tier)."""
        if self.prefix_cache.disk is not None:
            self.prefix_cache.disk.drain()

    def check_integrity(self) -> None:
        """Assert each store's pool and index agree (free + evictable + in-use == total)."""
        self.prefix_cache.check_integrity()
        self.chunk_store.check_integrity()

    def _make_pool(self, budget: int, block_size: int) -> KVPool:
        shape = self.runner.kv_shape
        return KVPool(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=block_size,
            budget_bytes=budget,
            dtype=self.runner.kv_dtype,
            device=self.runner.device,
        )

    def _make_prefix_cache(self, config: EngineConfig, block_size: int) -> PrefixCache:
        enabled = config.prefix_cache
        pool = self._make_pool(config.kv_cache_bytes if enabled else 0, block_size)
        reason = None if enabled else "prefix_cache=False (force-miss)"
        blocker = reuse_blocker(self.runner.model.config)
        if enabled and blocker is not None:
            logger.warning("prefix cache disabled for %r: %s", self.model_id, blocker)
            reason, enabled = blocker, False
        return PrefixCache(pool, is_enabled=enabled, disabled_reason=reason, policy=config.eviction)

    def _make_disk_tier(self, path: str, budget: int) -> DiskTier:
        pool = self.prefix_cache.pool
        # NOTE: the KV element type, not the compute dtype: fp16 blocks never meet fp32 ones
        layout = f"{pool.block_shape}|{self.runner.kv_dtype}"
        fingerprint = f"{self.runner.fingerprint}|{layout}"
        return DiskTier(path, budget_bytes=budget, fingerprint=fingerprint,
                        block_shape=pool.block_shape, dtype=self.runner.kv_dtype)  # fmt: skip
