"""Worker processes sharing one RedisStore on a real redis-server: each missing key runs once
across processes, a killed lock holder delays only its key and only until its lock expires, and
tenant isolation follows the same key rules as in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from agentcache.cache import MemoryStore, RedisStore, ToolCache, cache_scope
from tests.agentcache import _redis_worker

ROOT = Path(__file__).resolve().parents[2]


class KeyRecordingStore(MemoryStore):
    """A MemoryStore that remembers every key written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        self.keys.add(key)
        super().set(key, value, ttl_s=ttl_s)


def raw(reply: bytes | str) -> bytes:
    """A key or value read back from redis: bytes, as the client does not decode replies."""
    assert isinstance(reply, bytes)
    return reply


def spawn(*args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.agentcache._redis_worker", *map(str, args)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> Any:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"worker failed: {out!r}"
    return json.loads(out)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def wait_for(predicate: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the workers"
        time.sleep(0.01)


@pytest.mark.slow
def test_8_workers_x_200_calls_over_20_keys_compute_each_key_once(
    redis_url: str, namespace: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    # Eight forked processes (one interpreter start), each with its own RedisStore.
    launcher = spawn("many", redis_url, namespace, 8, 200, 20, 10.0)
    try:
        wait_for(lambda: int(client.get(f"{namespace}:ready") or 0) == 8 or launcher.poll())
        client.set(f"{namespace}:go", 1)
        outputs = finish(launcher)
    finally:
        stop(launcher)
    assert len(outputs) == 8
    computed = {raw(k).decode(): int(v) for k, v in client.hgetall(f"{namespace}:computed").items()}
    assert computed == {f"square:{n}": 1 for n in range(20)}  # each key computed once
    results: dict[int, set[str]] = {}
    for output in outputs:
        assert len(output) == 200
        for n, result in output:
            results.setdefault(n, set()).add(json.dumps(result, sort_keys=True))
    assert sorted(results) == list(range(20))
    for n, distinct in results.items():  # one result per key, from whichever worker ran it
        assert len(distinct) == 1, (n, distinct)
        assert json.loads(distinct.pop())["square"] == n * n
    assert client.keys(f"{namespace}:lock:*") == []  # every lease settled


@pytest.mark.slow
def test_killed_lock_holder_delays_its_key_by_at_most_the_lock_expiry(
    redis_url: str, namespace: str
) -> None:
    # NOTE: no wall-clock bound: the lease outlives any scheduling stall of this test (30 s), the
    # server's clock says how long it lives, and its expiry is brought forward on the server
    # once the "still live" checks are done.
    lock_ttl_s = 30.0
    client = redis.Redis.from_url(redis_url)
    holder = spawn("hold", redis_url, namespace, lock_ttl_s)
    store = RedisStore(redis_url, namespace=namespace, lock_ttl_s=5.0, wait_timeout_s=60.0)
    impatient = RedisStore(redis_url, namespace=namespace, wait_timeout_s=0.05)
    try:
        wait_for(lambda: client.exists(f"{namespace}:holding") or holder.poll() is not None)
        assert holder.poll() is None
        [lock] = client.keys(f"{namespace}:lock:*")
        key, held_by = raw(lock).decode().removeprefix(f"{namespace}:lock:"), client.get(lock)
        # The lease expires on its own within the lock expiry (-1 would be: never).
        assert 0 < client.pttl(lock) <= lock_ttl_s * 1000
        run = _redis_worker.tools(store, "survivor", client, namespace)
        assert run["square"](3)["computed_by"] == "survivor"  # other keys are not held up
        assert impatient.claim(key) == (None, None)  # not claimable while the lease is live
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert client.get(lock) == held_by  # the dead holder's lease outlived it, unchanged
        client.pexpire(lock, 100)  # NOTE: as if lock_ttl_s had passed since the holder's claim
        claim = store.claim(key)  # waits (polling) for the expiry
        assert claim.data is None and claim.lease is not None  # a lease, not a give-up
        claim.lease.release()
        value = _survivor_hang_result(store)
    finally:
        stop(holder)
        store.close()
        impatient.close()
    assert value == 7
    assert client.keys(f"{namespace}:lock:*") == []


def _survivor_hang_result(store: RedisStore) -> int:
    """Call the held tool's key (same name, version, arguments) with a body that returns."""

    def hang(n: int) -> int:
        return n

    tool = ToolCache(store).wrap(hang, name="hang", version="1")
    return int(tool(7))


def test_tenant_isolation_across_workers_matches_the_in_process_keys(
    redis_url: str, namespace: str
) -> None:
    workers = [spawn("tenants", redis_url, namespace, f"w{i}") for i in range(3)]
    outputs = [finish(proc) for proc in workers]
    client = redis.Redis.from_url(redis_url)
    computed = {raw(k).decode(): int(v) for k, v in client.hgetall(f"{namespace}:computed").items()}
    # Default scope: one entry per (tenant, user); scope="tenant": one per tenant.
    plan = _redis_worker.tenant_plan()
    expected = Counter(
        f"profile:{t}:{u}:{n}" if tool == "profile" else f"handbook:{t}:{n}"
        for t, u, tool, n in plan
    )
    assert computed == dict.fromkeys(expected, 1)
    for output in outputs:
        for (tenant, user, tool, _), result in zip(plan, output, strict=True):
            assert result["tenant"] == tenant  # never another tenant's result
            if tool == "profile":
                assert result["user"] == user
    # The same calls in one process, on a MemoryStore, produce exactly the same keys.
    memory = KeyRecordingStore()
    reference = _redis_worker.tools(memory, "ref", client, f"{namespace}-ref")
    for tenant, user, tool, n in plan:
        with cache_scope(tenant=tenant, user=user):
            reference[tool](n)
    prefix = f"{namespace}:v:".encode()
    redis_keys = {raw(k)[len(prefix) :].decode() for k in client.keys(f"{namespace}:v:*")}
    assert redis_keys == memory.keys and len(redis_keys) == len(expected)
