"""ToolCache: keys, scopes, exceptions, single-flight, result round trips."""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import enum
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
import pytest

from agentcache.cache import (
    CacheRecoveryWarning,
    CacheScopeError,
    CacheStore,
    DiskStore,
    MemoryStore,
    ToolCache,
    UncacheableResultWarning,
    cache_scope,
)
from agentcache.exceptions import CanonicalizationError, ConfigError


class Color(enum.Enum):
    RED = "red"


@dataclass(frozen=True)
class Point:
    x: int
    y: tuple[int, int]


class Weather(pydantic.BaseModel):
    city: str
    temp_c: float
    tags: list[str]


class Opaque:
    """No canonical form, no __eq__: neither a valid argument nor a cacheable result."""


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CacheStore]:
    s: CacheStore = MemoryStore() if request.param == "memory" else DiskStore(tmp_path / "c")
    yield s
    s.check_integrity()
    s.close()


class Counter:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def record(self, *args: Any) -> int:
        """Record one call; return how many calls so far."""
        with self.lock:
            self.calls.append(args)
            return len(self.calls)


def test_equivalent_calls_share_one_entry(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    @cache.cached()
    def search(query: str, limit: int = 3, *, lang: str = "en") -> list[str]:
        counter.record(query, limit, lang)
        return [f"{query}-{i}" for i in range(limit)]

    first = search("kv", 3)
    assert search("kv") == first
    assert search(query="kv", limit=3, lang="en") == first
    assert search("kv", limit=3) == first
    assert len(counter.calls) == 1
    search("kv", 4)
    search("kv", lang="de")
    assert len(counter.calls) == 3
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (3, 3)
    assert stats.entries == 3


def test_rich_arguments_are_canonicalized(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    @cache.cached()
    def tool(payload: dict[str, Any], tags: set[str], when: dt.datetime) -> int:
        counter.record(payload)
        return len(counter.calls)

    when = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    a = tool({"b": Decimal("1.50"), "a": Color.RED, "p": Point(1, (2, 3))}, {"y", "x"}, when)
    b = tool({"p": Point(1, (2, 3)), "a": "red", "b": 1.5}, {"x", "y"}, when)
    assert a == b == 1
    tool({"a": "blue"}, set(), when)
    assert len(counter.calls) == 2


def test_unsupported_argument_raises_naming_it(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    @cache.cached(name="fetch")
    def fetch(url: str, session: Any = None) -> str:
        counter.record(url)
        return url

    with pytest.raises(CanonicalizationError, match=r"'fetch'.*argument 'session'.*Opaque"):
        fetch("u", session=Opaque())
    with pytest.raises(TypeError, match="argument"):
        fetch("u", bogus=1)  # type: ignore[call-arg]
    assert counter.calls == []


def test_two_tenants_never_share_entries(store: CacheStore) -> None:
    cache = ToolCache(store)

    @cache.cached(scope="tenant")
    def balance(account: str) -> str:
        tenant = cache_scope_tenant()
        return f"{tenant}:{account}"

    with cache_scope(tenant="acme"):
        assert balance("main") == "acme:main"
    with cache_scope(tenant="globex"):
        assert balance("main") == "globex:main"
    with cache_scope(tenant="acme"):
        assert balance("main") == "acme:main"
    assert (cache.stats().hits, cache.stats().misses) == (1, 2)


def cache_scope_tenant() -> str | None:
    from agentcache.cache import current_scope

    return current_scope().tenant


@pytest.mark.parametrize("scope", ["tenant", "user", "session"])
def test_scoped_tool_without_scope_is_an_error(store: CacheStore, scope: Any) -> None:
    cache, counter = ToolCache(store), Counter()
    tool = cache.wrap(lambda x: counter.record(x), name="t", scope=scope)
    with pytest.raises(CacheScopeError, match=f"{scope}-scoped"):
        tool(1)
    with cache_scope(tenant="acme"):
        if scope == "tenant":
            tool(1)  # the tenant alone satisfies a tenant scope
        else:
            with pytest.raises(CacheScopeError, match=f"without a {scope}"):
                tool(1)
    assert len(counter.calls) == (1 if scope == "tenant" else 0)


def test_user_and_session_scopes_nest_and_isolate(store: CacheStore) -> None:
    cache = ToolCache(store)
    runs = Counter()

    @cache.cached(scope="user")
    def prefs() -> str:
        runs.record()
        return "p"

    with cache_scope(tenant="t1"):
        with cache_scope(user="u1"):
            prefs()
            prefs()
        with cache_scope(user="u2"):
            prefs()
    with cache_scope(tenant="t2", user="u1"):  # same user id, other tenant
        prefs()
    assert len(runs.calls) == 3


def test_global_tool_is_shared_across_tenants(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()
    tool = cache.wrap(lambda x: (counter.record(x), x)[1], name="g", scope="global")
    with cache_scope(tenant="a"):
        tool(1)
    with cache_scope(tenant="b"):
        tool(1)
    assert len(counter.calls) == 1


def test_default_scope_keys_by_every_id_the_active_scope_sets(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()
    tool = cache.wrap(lambda x: (counter.record(x), x)[1], name="d")
    tool(1)
    tool(1)  # no cache_scope: one caller, its own entry
    contexts = [
        {"tenant": "a"},
        {"tenant": "b"},
        {"tenant": "a", "user": "u"},
        {"tenant": "a", "user": "u", "session": "s1"},
        {"tenant": "a", "user": "u", "session": "s2"},
        {"user": "u"},
    ]
    for ids in contexts:
        with cache_scope(**ids):
            tool(1)
            tool(1)
    assert len(counter.calls) == 1 + len(contexts)


def test_a_wrapped_tool_is_never_wrapped_twice(store: CacheStore) -> None:
    cache = ToolCache(store)
    once = cache.wrap(lambda x: x, name="once", scope="user")
    with pytest.raises(ConfigError, match="never wrapped twice"):
        cache.wrap(once)
    with pytest.raises(ConfigError, match="never wrapped twice"):
        ToolCache(MemoryStore()).wrap(once, scope="global")


def test_depends_on_versions_the_key(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()
    state = {"version": "v1"}
    tool = cache.wrap(
        lambda x: (counter.record(x), state["version"])[1],
        name="stateful",
        depends_on=lambda: state["version"],
    )
    assert tool(1) == "v1"
    assert tool(1) == "v1"
    state["version"] = "v2"
    assert tool(1) == "v2"
    fixed = cache.wrap(lambda x: (counter.record(x), x)[1], name="fixed", depends_on="corpus-a")
    fixed(1)
    other = cache.wrap(lambda x: (counter.record(x), -x)[1], name="fixed", depends_on="corpus-b")
    assert other(1) == -1
    assert len(counter.calls) == 4
    with pytest.raises(ConfigError, match="depends_on"):
        cache.wrap(lambda: 0, name="bad", depends_on=3)  # type: ignore[arg-type]


def test_exceptions_are_not_cached(store: CacheStore) -> None:
    cache = ToolCache(store)
    attempts = Counter()

    @cache.cached()
    def flaky(x: int) -> int:
        attempts.record(x)
        if len(attempts.calls) == 1:
            raise RuntimeError("transient")
        return x * 2

    with pytest.raises(RuntimeError, match="transient"):
        flaky(2)
    assert flaky(2) == 4
    assert flaky(2) == 4
    assert len(attempts.calls) == 2


def test_side_effect_tools_always_run(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    def send_email(to: str) -> str:
        counter.record(to)
        return "sent"

    wrapped = cache.wrap(send_email, side_effects=True)
    wrapped("a")
    wrapped("a")
    assert len(counter.calls) == 2
    assert store.stats().entries == 0


def test_ttl_expires_tool_results(tmp_path: Path) -> None:
    now = [100.0]
    cache, counter = ToolCache(MemoryStore(clock=lambda: now[0])), Counter()
    tool = cache.wrap(lambda: counter.record(), name="t", ttl_s=5)
    assert tool() == 1
    now[0] += 4
    assert tool() == 1
    now[0] += 2
    assert tool() == 2


def test_version_and_name_change_the_key(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    def impl(x: int) -> int:
        counter.record(x)
        return x

    cache.wrap(impl, name="t", version="1")(1)
    cache.wrap(impl, name="t", version="1")(1)
    cache.wrap(impl, name="t", version="2")(1)
    cache.wrap(impl, name="u", version="1")(1)
    ToolCache(store, namespace="other").wrap(impl, name="t", version="1")(1)
    assert len(counter.calls) == 4


@pytest.mark.parametrize(
    "result",
    [
        {"b": [1.0, -0.0, 2], "a": None, "ü": "ß", "t": True},
        (1, [2, (3, "x")]),
        {"$": "looks like a tag", "v": 1},
        Point(1, (2, 3)),
        [Point(0, (0, 0)), {"k": Point(5, (6, 7))}],
        Weather(city="Oslo", temp_c=-3.5, tags=["cold"]),
        "plain string",
        None,
    ],
    ids=["json", "tuples", "dollar-key", "dataclass", "nested", "pydantic", "str", "none"],
)
def test_hits_return_equal_values_of_the_same_types(store: CacheStore, result: Any) -> None:
    cache = ToolCache(store)
    tool = cache.wrap(lambda: result, name="r")
    first, second = tool(), tool()
    assert cache.stats().hits == 1
    assert second == result
    assert type(second) is type(result)
    assert repr(second) == repr(result)  # same types all the way down
    if isinstance(result, dict | list):
        assert second is not first  # a hit is a fresh copy; mutating it cannot poison the cache


def test_uncacheable_result_warns_once_and_still_returns(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    def make() -> Opaque:
        counter.record()
        return Opaque()

    tool = cache.wrap(make, name="opaque")
    with pytest.warns(UncacheableResultWarning, match="allow_pickle"):
        assert isinstance(tool(), Opaque)
    assert isinstance(tool(), Opaque)  # second time: no warning (would raise under -W error)
    assert len(counter.calls) == 2


def test_pickle_only_when_allowed(store: CacheStore) -> None:
    value = {frozenset({1, 2}): "set keys need pickle"}
    picky = ToolCache(store, namespace="p", allow_pickle=True)
    tool = picky.wrap(lambda: value, name="fs")
    tool()
    assert tool() == value and picky.stats().hits == 1
    # A cache that does not allow pickle never unpickles, even sharing the namespace and key.
    strict = ToolCache(store, namespace="p")
    with (
        pytest.warns(UncacheableResultWarning, match="dict keys must be str"),
        pytest.warns(CacheRecoveryWarning, match="not allowed"),
    ):
        assert strict.wrap(lambda: value, name="fs")() == value


def test_bad_options_rejected(store: CacheStore) -> None:
    cache = ToolCache(store)
    with pytest.raises(ConfigError, match="scope must be one of"):
        cache.wrap(len, scope="team")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl_s"):
        cache.wrap(len, ttl_s=0)


def test_signature_and_async_preserved(store: CacheStore) -> None:
    import inspect

    cache = ToolCache(store)

    async def fetch(url: str, retries: int = 1) -> str:
        return url

    wrapped = cache.wrap(fetch)
    assert inspect.iscoroutinefunction(wrapped)
    assert inspect.signature(wrapped) == inspect.signature(fetch)
    assert wrapped.__name__ == "fetch"


def test_eight_threads_run_a_slow_tool_once(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()
    barrier = threading.Barrier(8)

    @cache.cached(scope="tenant")
    def slow(x: int) -> dict[str, int]:
        counter.record(x)
        time.sleep(0.2)
        return {"x": x}

    def call() -> dict[str, int]:
        barrier.wait()
        return slow(7)

    with cache_scope(tenant="t"), ThreadPoolExecutor(8) as pool:
        ctx = contextvars.copy_context()  # threads see the scope only when handed the context
        futures = [pool.submit(ctx.copy().run, call) for _ in range(8)]
        results = [f.result(timeout=10) for f in futures]
    assert results == [{"x": 7}] * 8
    assert len(counter.calls) == 1
    assert (cache.stats().hits, cache.stats().misses) == (7, 1)


async def test_eight_tasks_run_a_slow_async_tool_once(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    @cache.cached(scope="session")
    async def slow(x: int) -> list[int]:
        counter.record(x)
        await asyncio.sleep(0.2)
        return [x, x]

    with cache_scope(session="s1"):  # tasks created inside inherit the scope
        results = await asyncio.gather(*(slow(3) for _ in range(8)))
    assert results == [[3, 3]] * 8
    assert len(counter.calls) == 1


async def test_failing_leader_lets_waiters_retry(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()

    @cache.cached()
    async def flaky() -> str:
        counter.record()
        await asyncio.sleep(0.05)
        if len(counter.calls) == 1:
            raise RuntimeError("first run fails")
        return "ok"

    results = await asyncio.gather(*(flaky() for _ in range(4)), return_exceptions=True)
    assert isinstance(results[0], RuntimeError)
    assert results[1:] == ["ok"] * 3
    assert len(counter.calls) == 2  # one failure, then one success shared by the rest


async def test_cancelled_waiter_does_not_cancel_the_runner(store: CacheStore) -> None:
    cache, counter = ToolCache(store), Counter()
    # NOTE: the runner ends when the test says so, never on a clock: with a timed runner a loop
    # stalled ~0.1 s under load let it finish first, and the waiter got 42 instead of cancelled.
    release = asyncio.Event()

    @cache.cached()
    async def slow() -> int:
        counter.record()
        await release.wait()
        return 42

    leader = asyncio.create_task(slow())
    while not counter.calls:
        await asyncio.sleep(0)  # one loop turn at a time until the leader runs the tool
    waiter, bystander = asyncio.create_task(slow()), asyncio.create_task(slow())
    # One loop turn runs both waiters' first steps (ready callbacks run in FIFO order): each
    # misses, finds the leader's flight and waits on it.
    await asyncio.sleep(0)
    assert not (waiter.done() or bystander.done() or leader.done())
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not leader.done()  # the runner goes on
    release.set()
    assert await leader == 42
    assert await bystander == 42  # the flight it shares with the cancelled waiter still lands
    assert await slow() == 42
    assert len(counter.calls) == 1
