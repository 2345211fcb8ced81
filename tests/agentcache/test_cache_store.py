"""CacheStore contract, run against MemoryStore, DiskStore and RedisStore (a real server) alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcache.cache import CacheStats, CacheStore, DiskStore, MemoryStore, create_store
from agentcache.exceptions import ConfigError


class FakeClock:
    """Manually advanced time source (seconds)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_store(kind: str, tmp_path: Path, clock: FakeClock, size_limit: int) -> CacheStore:
    if kind == "memory":
        return MemoryStore(size_limit_bytes=size_limit, clock=clock)
    return DiskStore(tmp_path / "cache", size_limit_bytes=size_limit, clock=clock)


@pytest.fixture(params=["memory", "disk", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(
    kind: str, tmp_path: Path, clock: FakeClock, request: pytest.FixtureRequest
) -> Iterator[CacheStore]:
    if kind == "redis":  # NOTE: TTLs are checked on the injected clock as well as natively
        url = request.getfixturevalue("redis_url")
        s: CacheStore = create_store("redis", url=url, clock=clock)
    else:
        s = make_store(kind, tmp_path, clock, 64 * 1024 * 1024)
    yield s
    s.check_integrity()
    s.close()


def test_implements_protocol(store: CacheStore) -> None:
    assert isinstance(store, CacheStore)


def test_get_set_delete_and_stats(store: CacheStore) -> None:
    assert store.get("a") is None
    store.set("a", b"alpha")
    store.set("b", b"")
    assert store.get("a") == b"alpha"
    assert store.get("b") == b""
    store.set("a", b"again")
    assert store.get("a") == b"again"
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.get("a") is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.entries) == (3, 2, 1)
    assert stats.hit_rate == pytest.approx(3 / 5)
    assert stats.bytes > 0


def test_ttl_expiry_uses_injected_clock(store: CacheStore, clock: FakeClock) -> None:
    store.set("short", b"1", ttl_s=10)
    store.set("forever", b"2")
    clock.now += 9.9
    assert store.get("short") == b"1"
    clock.now += 0.2
    assert store.get("short") is None
    assert store.get("forever") == b"2"
    assert store.stats().entries == 1  # the expired entry was deleted when found


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), float("nan"), True, "5"])
def test_invalid_ttl_rejected(store: CacheStore, ttl: object) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        store.set("k", b"v", ttl_s=ttl)  # type: ignore[arg-type]


def test_clear_keeps_counters(store: CacheStore) -> None:
    store.set("a", b"1")
    assert store.get("a") == b"1"
    store.clear()
    assert store.get("a") is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 1, 0)


def test_memory_eviction_is_lru_within_budget(clock: FakeClock) -> None:
    # Each entry is 1 (key) + 99 (value) = 100 bytes; the budget holds three.
    store = MemoryStore(size_limit_bytes=300, clock=clock)
    for key in "abc":
        store.set(key, b"x" * 99)
    assert store.get("a") is not None  # bump a: b is now least recently used
    store.set("d", b"x" * 99)
    assert [k for k in "abcd" if store.get(k) is not None] == ["a", "c", "d"]
    assert store.stats().bytes == 300
    store.set("huge", b"x" * 400)  # larger than the whole budget: not stored
    assert store.get("huge") is None
    store.check_integrity()


def test_disk_eviction_keeps_size_bounded(tmp_path: Path) -> None:
    limit = 256 * 1024
    store = DiskStore(tmp_path / "c", size_limit_bytes=limit)
    for i in range(200):
        store.set(f"k{i}", bytes([i % 256]) * 4000)  # 800 kB written in total
    stats = store.stats()
    assert stats.entries < 200
    assert stats.bytes <= limit + 10 * 4100  # diskcache culls up to 10 entries per write
    assert store.get("k199") == bytes([199]) * 4000  # newest survives
    assert store.get("k0") is None  # oldest stored was evicted
    store.check_integrity()


def test_values_persist_across_disk_store_instances(tmp_path: Path) -> None:
    first = DiskStore(tmp_path / "c")
    first.set("k", b"v" * 100_000)  # large enough to live in a value file
    first.set("t", b"ttl", ttl_s=60)
    first.close()
    second = DiskStore(tmp_path / "c")
    assert second.get("k") == b"v" * 100_000
    assert second.get("t") == b"ttl"
    second.check_integrity()


def test_bad_size_limits_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size_limit_bytes"):
        MemoryStore(size_limit_bytes=0)
    with pytest.raises(ValueError, match="size_limit_bytes"):
        DiskStore(tmp_path, size_limit_bytes=1.5)  # type: ignore[arg-type]


def test_create_store_by_name(tmp_path: Path) -> None:
    assert isinstance(create_store("memory"), MemoryStore)
    assert isinstance(create_store("disk", tmp_path / "d"), DiskStore)
    with pytest.raises(ConfigError, match="memory, disk, redis"):
        create_store("sqlite")
    with pytest.raises(ConfigError, match="directory"):
        create_store("disk")


def test_stats_since_and_hit_rate() -> None:
    before = CacheStats(hits=2, misses=2, entries=3, bytes=10)
    after = CacheStats(hits=5, misses=3, entries=4, bytes=20)
    delta = after.since(before)
    assert (delta.hits, delta.misses, delta.entries, delta.bytes) == (3, 1, 4, 20)
    assert delta.hit_rate == pytest.approx(0.75)
    assert CacheStats(0, 0, 0, 0).hit_rate == 0.0
