"""ChunkStore: chunks' KV by (namespace, token ids) in a byte budget, evicted by policy.

Scenarios on a toy pool of 6 blocks of 4 positions; every scenario ends with check_integrity.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.cache.chunk_store import ChunkStore, chunk_key
from runtime.cache.disk_tier import DISK_HEADER_BYTES, DiskTier
from runtime.cache.kv_pool import KVPool
from runtime.cache.radix_cache import Namespace

NS, OTHER = Namespace("a" * 64), Namespace("b" * 64)
SHAPE = (2, 2, 3, 5)  # L, 2, H_kv, D around the position axis


def make_store(num_blocks: int = 6, policy: str = "lru") -> ChunkStore:
    block_bytes = 2 * 2 * 3 * 4 * 5 * 4  # L * 2 * H * block_size * D * fp32
    pool = KVPool(num_layers=2, num_kv_heads=3, head_dim=5, block_size=4,
                  budget_bytes=num_blocks * block_bytes, dtype=torch.float32,
                  device=torch.device("cpu"))  # fmt: skip
    return ChunkStore(pool, policy=policy)  # type: ignore[arg-type]


def kv_of(n: int, seed: int) -> torch.Tensor:
    return torch.randn(*SHAPE[:3], n, SHAPE[3], generator=torch.Generator().manual_seed(seed))


def test_put_then_get_returns_the_same_kv() -> None:
    store = make_store()
    kv = kv_of(6, 0)  # 6 positions: one whole block and a partial one
    assert store.get(NS, [1, 2, 3, 4, 5, 6]) is None
    assert store.put(NS, [1, 2, 3, 4, 5, 6], kv)
    got = store.get(NS, [1, 2, 3, 4, 5, 6])
    assert got is not None and torch.equal(got, kv)
    assert (store.num_hits, store.num_misses, store.num_entries) == (1, 1, 1)
    assert store.bytes_used == 2 * store.pool.block_bytes
    store.check_integrity()


def test_namespaces_and_token_ids_key_entries() -> None:
    store = make_store()
    store.put(NS, [1, 2, 3], kv_of(3, 0))
    assert store.get(OTHER, [1, 2, 3]) is None  # another tenant or model
    assert store.get(NS, [1, 2, 4]) is None
    assert store.get(NS, [1, 2]) is None  # a prefix of a chunk is another chunk
    assert chunk_key(NS, [1, 2, 3]) != chunk_key(OTHER, [1, 2, 3])
    assert chunk_key(NS, [1, 2, 3]) == chunk_key(NS, (1, 2, 3))
    store.check_integrity()


def test_budget_evicts_least_recently_used_first() -> None:
    store = make_store(num_blocks=6, policy="lru")
    for k in range(3):  # three chunks of 2 blocks fill the pool
        assert store.put(NS, [k] * 8, kv_of(8, k))
    assert store.pool.num_free == 0
    assert store.get(NS, [0] * 8) is not None  # chunk 0 is now the most recent
    assert store.put(NS, [7] * 5, kv_of(5, 7))  # needs 2 blocks: chunk 1 goes
    assert store.get(NS, [1] * 8) is None
    assert store.get(NS, [0] * 8) is not None and store.get(NS, [2] * 8) is not None
    assert store.num_evictions == 1
    store.check_integrity()


def test_shared_policy_keeps_often_used_chunks() -> None:
    store = make_store(num_blocks=4, policy="shared")
    store.put(NS, [1] * 8, kv_of(8, 1))
    for _ in range(3):
        store.get(NS, [1] * 8)  # used by three more requests
    store.put(NS, [2] * 8, kv_of(8, 2))  # one use, touched last
    store.put(NS, [3] * 8, kv_of(8, 3))  # no room: the one-off chunk 2 goes, not chunk 1
    assert store.get(NS, [1] * 8) is not None and store.get(NS, [2] * 8) is None
    store.check_integrity()


def test_chunk_larger_than_budget_is_not_stored() -> None:
    store = make_store(num_blocks=2)
    store.put(NS, [1] * 4, kv_of(4, 1))
    assert not store.put(NS, [2] * 9, kv_of(9, 2))  # 3 blocks > 2
    assert store.get(NS, [1] * 4) is not None  # nothing was evicted for it
    empty = make_store(num_blocks=0)
    assert not empty.put(NS, [1], kv_of(1, 1)) and empty.get(NS, [1]) is None
    store.check_integrity()
    empty.check_integrity()


def test_put_twice_keeps_one_entry_and_flush_frees_all() -> None:
    store = make_store()
    store.put(NS, [1, 2], kv_of(2, 1))
    assert store.put(NS, [1, 2], kv_of(2, 2))
    assert store.num_entries == 1
    store.put(NS, [3, 4], kv_of(2, 3))
    assert store.flush() == 2 and store.pool.num_free == store.pool.num_blocks
    store.check_integrity()
    store.put(NS, [5], kv_of(1, 5))
    store.check_integrity()


def test_check_integrity_catches_a_leaked_block() -> None:
    store = make_store()
    store.put(NS, [1, 2], kv_of(2, 1))
    store.pool.allocate(1)  # a block taken outside the store
    with pytest.raises(AssertionError, match="free"):
        store.check_integrity()


def disk_tier(path: Path, fingerprint: str = "w0") -> DiskTier:
    block_bytes = 2 * 2 * 3 * 4 * 5 * 4
    return DiskTier(path, budget_bytes=64 * (block_bytes + DISK_HEADER_BYTES),
                    fingerprint=fingerprint, block_shape=(2, 2, 3, 4, 5),
                    dtype=torch.float32)  # fmt: skip


def test_an_evicted_chunk_comes_back_from_the_disk_tier_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    store = make_store(num_blocks=2, policy="lru")
    store.disk = disk_tier(tmp_path)
    first, second = kv_of(6, 0), kv_of(5, 1)
    assert store.put(NS, [1] * 6, first) and store.put(NS, [2] * 5, second)  # evicts [1] * 6
    assert store.num_evictions == 1 and store.num_entries == 1
    store.disk.drain()
    got = store.get(NS, [1] * 6)  # from disk, back into memory (evicting [2] * 5)
    assert got is not None and torch.equal(got, first)
    assert (store.num_hits, store.num_disk_hits, store.num_misses) == (1, 1, 0)
    assert store.get(OTHER, [1] * 6) is None  # another namespace never finds it
    store.check_integrity()
    store.disk.drain()
    store.disk.close()
    restarted = make_store(num_blocks=2)
    restarted.disk = disk_tier(tmp_path)
    again = restarted.get(NS, [2] * 5)  # spilled when it was evicted above
    assert again is not None and torch.equal(again, second)
    assert restarted.snapshot().num_disk_hits == 1
    restarted.disk.close()
    other_weights = make_store(num_blocks=2)
    other_weights.disk = disk_tier(tmp_path, fingerprint="w1")
    assert other_weights.get(NS, [2] * 5) is None  # another model's files are never read
    other_weights.disk.close()


def test_a_chunk_with_a_damaged_block_on_disk_is_a_miss(tmp_path: Path) -> None:
    store = make_store(num_blocks=2)
    store.disk = disk_tier(tmp_path)
    store.put(NS, [1] * 6, kv_of(6, 0))
    store.flush()  # spills, as the prefix cache's flush does
    store.disk.drain()
    files = sorted(tmp_path.glob("*.kvb"))
    assert len(files) == 2  # one file per block of the chunk
    files[1].write_bytes(files[1].read_bytes()[:-7])  # a truncated block
    assert store.get(NS, [1] * 6) is None and store.num_misses == 1
    assert not store.flush(spill=False)  # nothing left in memory either
    store.disk.close()
