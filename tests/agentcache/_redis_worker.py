"""One agent worker process of the RedisStore multi-process tests.

Run as ``python -m tests.agentcache._redis_worker MODE URL NAMESPACE [ARGS...]``; prints one JSON
line. Tools have explicit names and versions so their keys match the ones built in the test
process (a default version would include the module name, ``__main__`` here).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import redis

from agentcache.cache import CacheStore, RedisStore, ToolCache, cache_scope, current_scope

COMPUTE_S = 0.05  # long enough that workers asking for the same key overlap


def tools(store: CacheStore, worker: str, counter: redis.Redis, namespace: str) -> dict[str, Any]:
    """The tools every worker (and the in-process reference run) wraps."""
    cache = ToolCache(store)

    def square(n: int) -> dict[str, Any]:
        counter.hincrby(f"{namespace}:computed", f"square:{n}", 1)
        time.sleep(COMPUTE_S)
        return {"n": n, "square": n * n, "computed_by": worker}

    def profile(n: int) -> dict[str, Any]:
        scope = current_scope()
        counter.hincrby(f"{namespace}:computed", f"profile:{scope.tenant}:{scope.user}:{n}", 1)
        return {"n": n, "tenant": scope.tenant, "user": scope.user}

    def handbook(n: int) -> dict[str, Any]:
        tenant = current_scope().tenant
        counter.hincrby(f"{namespace}:computed", f"handbook:{tenant}:{n}", 1)
        return {"n": n, "tenant": tenant}

    def hang(n: int) -> int:
        counter.set(f"{namespace}:holding", n)
        time.sleep(60)
        return n

    return {
        "square": cache.wrap(square, name="square", version="1"),
        "profile": cache.wrap(profile, name="profile", version="1"),  # default: narrowest
        "handbook": cache.wrap(handbook, name="handbook", version="1", scope="tenant"),
        "hang": cache.wrap(hang, name="hang", version="1"),
    }


def tenant_plan() -> list[tuple[str, str, str, int]]:
    """(tenant, user, tool, n) calls of the tenant-isolation test, in one fixed order."""
    return [
        (tenant, user, tool, n)
        for tenant in ("acme", "globex")
        for user in ("ann", "bob")
        for tool in ("profile", "handbook")
        for n in range(3)
    ]


def run_many(run: dict[str, Any], counter: redis.Redis, ns: str, argv: list[str]) -> Any:
    """``argv``: worker name, number of calls, number of distinct keys; all start together."""
    worker, num_calls, num_keys = argv[0], int(argv[1]), int(argv[2])
    order = [i % num_keys for i in range(num_calls)]
    random.Random(worker).shuffle(order)
    counter.incr(f"{ns}:ready")
    while not counter.exists(f"{ns}:go"):  # start together, so calls really overlap
        time.sleep(0.005)
    return [[n, run["square"](n)] for n in order]


def fork_many(url: str, namespace: str, argv: list[str], lock_ttl_s: float) -> Any:
    """Fork ``argv[0]`` worker processes (imports paid once, here) that each run ``run_many``."""
    num_workers, rest = int(argv[0]), argv[1:]
    children = []
    for index in range(num_workers):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # NOTE: the child opens its own Redis connections after the fork
            code = 1
            try:
                os.close(read_fd)
                store = RedisStore(url, namespace=namespace, lock_ttl_s=lock_ttl_s)
                counter = redis.Redis.from_url(url)
                run = tools(store, f"w{index}", counter, namespace)
                result = run_many(run, counter, namespace, [f"w{index}", *rest])
                with os.fdopen(write_fd, "wb") as out:
                    out.write(json.dumps(result).encode())
                code = 0
            finally:
                os._exit(code)  # never run the parent's code in the child
        os.close(write_fd)
        children.append((pid, read_fd))
    results = []
    for pid, read_fd in children:
        with os.fdopen(read_fd, "rb") as pipe:
            results.append(json.loads(pipe.read()))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"worker {pid} failed"
    return results


def run_tenants(run: dict[str, Any]) -> Any:
    out = []
    for tenant, user, tool, n in tenant_plan():
        with cache_scope(tenant=tenant, user=user):
            out.append(run[tool](n))
    return out


def main(argv: list[str]) -> None:
    mode, url, namespace, *rest = argv
    lock_ttl_s = float(rest.pop()) if mode in ("many", "hold") else 30.0
    if mode == "many":
        print(json.dumps(fork_many(url, namespace, rest, lock_ttl_s), sort_keys=True))
        return
    store = RedisStore(url, namespace=namespace, lock_ttl_s=lock_ttl_s)
    counter = redis.Redis.from_url(url)
    run = tools(store, f"{mode}-{rest[0] if rest else ''}", counter, namespace)
    if mode == "tenants":
        result = run_tenants(run)
    elif mode == "hold":
        result = run["hang"](7)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
