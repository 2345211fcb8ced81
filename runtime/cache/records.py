"""Plain records of the cache floor: stats snapshots and the disk tier's policy names.

No torch and no threads: ``runtime.outputs`` and the server's metrics read these types without
loading the cache's tensor code, and ``runtime.config`` takes the disk policy names from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["DISK_POLICIES", "ChunkStoreStats", "DiskPolicy", "DiskStats", "DiskTierStats"]

DiskPolicy = Literal["write-through", "evict"]
"""When a block reaches the disk tier: ``"write-through"`` as soon as it is cached (queued in the
background, so a clean restart finds it), or ``"evict"`` only when the pool evicts it."""
DISK_POLICIES: tuple[str, ...] = get_args(DiskPolicy)


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """The disk tier below the KV pool, since the engine started (``CacheStats.disk``)."""

    bytes_used: int
    """Bytes of block files in the directory now (headers included)."""
    bytes_total: int
    """Byte budget of the directory."""
    num_blocks: int
    """Block files in the directory now."""
    num_writes: int
    """Blocks written (spilled from the pool)."""
    num_dropped_writes: int
    """Spills dropped because the write queue was full (the request never waits on disk)."""
    num_loads: int
    """Blocks read back into the pool."""
    load_s: float
    """Seconds spent reading and verifying blocks on the request path (prefetched ones free)."""
    num_corrupt: int
    """Damaged, truncated or foreign files found, treated as misses and removed."""
    bytes_written: int = 0
    """Bytes of block files written since start (headers included)."""

    @property
    def mean_load_ms(self) -> float:
        """Mean milliseconds per loaded block (0.0 before any load)."""
        return 1000 * self.load_s / self.num_loads if self.num_loads else 0.0


class DiskStats:
    """Counters of one ``DiskTier`` (read under its lock)."""

    __slots__ = (
        "bytes_used", "bytes_written", "load_s", "num_corrupt", "num_dropped", "num_loads",
        "num_writes",
    )  # fmt: skip

    def __init__(self) -> None:
        self.bytes_used = 0
        """Bytes of block files now in the directory (headers included)."""
        self.bytes_written = 0
        """Bytes of block files written since start (headers included)."""
        self.num_writes = 0
        """Block files written since start."""
        self.num_dropped = 0
        """Writes dropped because the queue was full (the block is just not kept)."""
        self.num_loads = 0
        """Blocks read back (from a file or the staging area)."""
        self.load_s = 0.0
        """Seconds spent reading and verifying blocks in ``load`` (prefetched reads are free)."""
        self.num_corrupt = 0
        """Damaged, truncated or foreign files found and removed."""


@dataclass(frozen=True, slots=True)
class ChunkStoreStats:
    """The chunk store's counters since the engine started, occupancy now (``CacheStats``).

    Lookups count chunks (one per distinct document chunk of a request), not tokens; the tokens
    a request reused are in its ``Usage.chunk_reuse``.
    """

    num_entries: int
    """Chunks stored now."""
    bytes_used: int
    """Bytes of the blocks holding stored chunks."""
    bytes_total: int
    """The store's byte budget as allocated (whole blocks)."""
    num_hits: int
    """Chunk lookups served from the store."""
    num_misses: int
    """Chunk lookups not in the store (computed alone, then stored when it fits)."""
    num_evictions: int
    """Chunks evicted to make room."""
    num_disk_hits: int = 0
    """Of ``num_hits``, chunks loaded back from the disk tier (a miss in memory)."""
