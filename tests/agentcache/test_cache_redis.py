"""RedisStore beyond the shared contract, on a real redis-server: native TTLs, namespaces, damaged
entries, fenced leases, errors never cached, and an outage with a restart."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import redis

from agentcache.cache import CacheWarning, RedisStore, SharedFlightStore, ToolCache, create_store
from agentcache.cache._redis_server import LocalRedisServer
from agentcache.cache.base import CacheRecoveryWarning
from agentcache.exceptions import CacheIntegrityError, ConfigError


def make_store(url: str, namespace: str, **options: float) -> RedisStore:
    return RedisStore(url, namespace=namespace, **options)  # type: ignore[arg-type]


def raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def test_create_store_reads_the_url_from_the_environment(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTCACHE_REDIS_URL", redis_url)
    store = create_store("redis", namespace="env")
    assert isinstance(store, RedisStore) and isinstance(store, SharedFlightStore)
    store.set("k", b"v")
    assert raw_client(redis_url).exists("env:v:k") == 1
    store.close()
    monkeypatch.delenv("AGENTCACHE_REDIS_URL")
    with pytest.raises(ConfigError, match="AGENTCACHE_REDIS_URL"):
        create_store("redis")
    with pytest.raises(ConfigError, match="takes no url"):
        create_store("memory", url=redis_url)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="bad redis url"):
        RedisStore("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="lock_ttl_s"):
        RedisStore("redis://127.0.0.1:1", lock_ttl_s=0)
    with pytest.raises(ValueError, match="max_entry_bytes"):
        RedisStore("redis://127.0.0.1:1", max_entry_bytes=10)
    with pytest.raises(ConfigError, match="without ':'"):
        RedisStore("redis://127.0.0.1:1", namespace="app:cache")


def test_entries_get_a_native_ttl_and_stay_in_their_namespace(redis_url: str) -> None:
    a, b = make_store(redis_url, "ns-a"), make_store(redis_url, "ns-b")
    a.set("k", b"a", ttl_s=30)
    b.set("k", b"b")
    client = raw_client(redis_url)
    assert 29_000 < client.pttl("ns-a:v:k") <= 30_000
    assert client.pttl("ns-b:v:k") == -1  # no expiry
    assert (a.get("k"), b.get("k")) == (b"a", b"b")
    a.clear()
    assert (a.get("k"), b.get("k")) == (None, b"b")
    assert a.stats().entries == 0 and b.stats().entries == 1


def test_oversized_value_is_not_stored_and_drops_the_old_one(redis_url: str) -> None:
    store = RedisStore(redis_url, max_entry_bytes=1000)
    store.set("k", b"small")
    store.set("k", b"x" * 1000)
    assert store.get("k") is None


def test_damaged_entry_is_a_miss_with_a_warning(redis_url: str, namespace: str) -> None:
    store = make_store(redis_url, namespace)
    store.set("k", b"payload")
    client = raw_client(redis_url)
    raw = client.get(f"{namespace}:v:k")
    assert isinstance(raw, bytes)
    client.set(f"{namespace}:v:k", raw[:-1] + b"X")
    with pytest.raises(CacheIntegrityError, match="fails its checksum"):
        store.check_integrity()
    with pytest.warns(CacheRecoveryWarning, match="checksum"):
        assert store.get("k") is None
    assert client.exists(f"{namespace}:v:k") == 0
    store.check_integrity()


def test_server_out_of_memory_skips_the_write_with_a_warning(
    private_redis: LocalRedisServer,
) -> None:
    client = raw_client(private_redis.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # NOTE: 1 byte: every write is refused with OOM
    store = RedisStore(private_redis.url)
    with pytest.warns(CacheWarning, match="maxmemory"):
        store.set("k", b"v")
    client.config_set("maxmemory", 0)
    assert store.get("k") is None


# -- leases ----------------------------------------------------------------------------------------


def test_one_lease_per_key_and_waiters_time_out_instead_of_hanging(
    redis_url: str, namespace: str
) -> None:
    holder = make_store(redis_url, namespace, lock_ttl_s=5)
    waiter = make_store(redis_url, namespace, lock_ttl_s=5, wait_timeout_s=0.2)
    first = holder.claim("k")
    assert first.data is None and first.lease is not None and first.lease.token > 0
    start = time.monotonic()
    assert waiter.claim("k") == (None, None)  # timed out: the caller computes itself
    assert 0.2 <= time.monotonic() - start < 2.0
    assert first.lease.commit(b"value", ttl_s=None) is True
    assert waiter.claim("k") == (b"value", None)  # stored: a hit, no lease
    holder.check_integrity()


def test_waiter_gets_the_value_the_holder_commits(redis_url: str, namespace: str) -> None:
    holder = make_store(redis_url, namespace, lock_ttl_s=5)
    lease = holder.claim("k").lease
    assert lease is not None
    timer = threading.Timer(0.2, lambda: lease.commit(b"done", ttl_s=60))
    timer.start()
    claim = make_store(redis_url, namespace, lock_ttl_s=5).claim("k")
    timer.join()
    assert claim == (b"done", None)


def test_stale_holder_cannot_overwrite_the_newer_result(redis_url: str, namespace: str) -> None:
    store = make_store(redis_url, namespace, lock_ttl_s=0.2)
    stale = store.claim("k").lease
    assert stale is not None
    time.sleep(0.3)  # the stale holder's lock expires while it still computes
    fresh = store.claim("k").lease
    assert fresh is not None and fresh.token > stale.token
    assert fresh.commit(b"new", ttl_s=None) is True
    assert stale.commit(b"old", ttl_s=None) is False  # fenced out
    assert store.get("k") == b"new"
    stale.release()  # settled already: does nothing
    assert store.get("k") == b"new"


def test_released_lease_lets_the_next_caller_claim(redis_url: str, namespace: str) -> None:
    store = make_store(redis_url, namespace, lock_ttl_s=5)
    lease = store.claim("k").lease
    assert lease is not None
    lease.release()
    again = store.claim("k").lease
    assert again is not None and again.token > lease.token
    assert lease.commit(b"late", ttl_s=None) is False  # released: settled once
    again.release()
    assert raw_client(redis_url).keys(f"{namespace}:lock:*") == []


def test_errors_are_never_cached_and_a_waiting_process_runs_the_tool(
    redis_url: str, namespace: str
) -> None:
    # Two ToolCache objects stand for two processes: each has its own in-process single-flight.
    runs: list[str] = []
    started = threading.Event()

    def flaky(x: int) -> int:
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            started.set()
            time.sleep(0.3)
            raise RuntimeError("upstream down")
        return x * 2

    tools = [
        ToolCache(make_store(redis_url, namespace, lock_ttl_s=5)).wrap(flaky, name="flaky")
        for _ in range(2)
    ]
    errors: list[BaseException] = []

    def first() -> None:
        try:
            tools[0](21)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=first, name="first")
    thread.start()
    started.wait(5)
    assert tools[1](21) == 42  # waited for the failing holder, then ran it itself
    thread.join()
    assert [str(e) for e in errors] == ["upstream down"] and len(runs) == 2
    assert tools[0](21) == 42 and len(runs) == 2  # now a hit


# -- outage ------------------------------------------------------------------------------------


def test_redis_stopped_mid_run_computes_warns_once_and_recovers(
    private_redis: LocalRedisServer,
) -> None:
    runs: list[int] = []

    def square(n: int) -> int:
        runs.append(n)
        return n * n

    store = RedisStore(private_redis.url, retry_interval_s=0.2, timeout_s=0.5)
    tool = ToolCache(store).wrap(square, name="square")
    assert [tool(3), tool(3)] == [9, 9] and runs == [3]
    private_redis.stop()
    with pytest.warns(CacheWarning) as caught:
        results = [tool(n) for n in (3, 4, 3, 4)]
        time.sleep(0.3)  # past the retry interval: the next call tries Redis again, still down
        results += [tool(3)]
    assert results == [9, 16, 9, 16, 9] and runs == [3, 3, 4, 3, 4, 3]
    assert len([w for w in caught if "unreachable" in str(w.message)]) == 1
    private_redis.start()  # same port, empty (no persistence)
    time.sleep(0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [tool(3), tool(3), tool(4)] == [9, 9, 16]
    assert runs == [3, 3, 4, 3, 4, 3, 3, 4]  # one miss each after the restart, then a hit
    assert store.stats().entries == 2
    store.check_integrity()


async def test_async_tools_share_one_run_across_stores(redis_url: str, namespace: str) -> None:
    import asyncio

    runs: list[int] = []

    async def fetch(n: int) -> int:
        runs.append(n)
        await asyncio.sleep(0.2)
        return n + 1

    # Two ToolCache objects on two stores stand for two processes.
    tools = [
        ToolCache(make_store(redis_url, namespace, lock_ttl_s=5)).wrap(fetch, name="fetch")
        for _ in range(2)
    ]
    results = await asyncio.gather(*(tools[i % 2](1) for i in range(6)))
    assert results == [2] * 6 and runs == [1]
