"""``agentcache bench cache``: latency of tool-cache hits and misses against calling the tool.

Measures, in one run and on the same machine: the bare tool call, ToolCache misses (fresh
arguments each call) and hits on DiskStore and MemoryStore, and RetrievalCache hits on DiskStore;
with ``--store redis`` also on RedisStore (a server at ``--redis-url`` / ``AGENTCACHE_REDIS_URL``,
or a private ``redis-server`` on loopback). The budget is a DiskStore hit p50 <= 0.5 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agentcache import env
from agentcache._argtypes import positive_int
from agentcache.cache.base import CacheStore
from agentcache.cache.disk import DiskStore, file_on_path
from agentcache.cache.keys import index_fingerprint
from agentcache.cache.memory import MemoryStore
from agentcache.cache.retrieval import RetrievalCache
from agentcache.cache.tool import ToolCache
from agentcache.exceptions import CacheError

__all__ = ["main"]

DESCRIPTION = (
    "Latency of tool-cache hits and misses against calling the tool itself, measured in one run "
    "on this machine: the bare call, ToolCache misses and hits on DiskStore and MemoryStore, and "
    "RetrievalCache hits on DiskStore; with --store redis also on RedisStore. The budget is a "
    "DiskStore hit p50 <= 0.5 ms."
)

HIT_P50_TARGET_MS = 0.5


def _weather(city: str, units: str = "metric", *, days: int = 1) -> dict[str, Any]:
    """A small JSON result (~150 bytes), like a typical tool answer."""
    return {"city": city, "units": units, "days": days, "temp": [21.5] * days, "ok": True}


def _time_calls(fn: Callable[[int], object], iterations: int) -> list[float]:
    samples = []
    for i in range(iterations):
        start = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def _summary(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_ms": statistics.median(samples), "p99_ms": cuts[98]}


def _tool_rows(label: str, store: CacheStore, iterations: int) -> dict[str, dict[str, float]]:
    tool = ToolCache(store, namespace=f"bench-{time.time_ns()}").wrap(_weather, name="weather")
    misses = _time_calls(lambda i: tool(f"city-{i}", days=2), iterations)
    tool("Oslo", days=2)
    hits = _time_calls(lambda i: tool("Oslo", days=2), iterations)
    return {f"{label}_miss": _summary(misses), f"{label}_hit": _summary(hits)}


def _retrieval_row(store: CacheStore, iterations: int) -> dict[str, dict[str, float]]:
    cache = RetrievalCache(store)
    fingerprint = index_fingerprint((f"doc{i}", f"text {i}") for i in range(1000))
    results = [{"id": f"doc{i}", "score": 1.0 / (i + 1)} for i in range(5)]

    def lookup(_: int) -> object:
        return cache.get_or_compute(
            retriever_id="bm25",
            index_fingerprint=fingerprint,
            query="how does prefix caching work",
            k=5,
            compute=lambda: results,
        )

    lookup(0)
    return {"disk_retrieval_hit": _summary(_time_calls(lookup, iterations))}


def run(iterations: int, directory: str, *, redis_url: str | None = None) -> dict[str, Any]:
    """Run every measurement; returns ``{row: {"p50_ms", "p99_ms"}, ...}`` plus overheads.

    ``redis_url`` adds ``redis_miss`` / ``redis_hit`` rows (a fresh namespace; removed after).
    """
    rows: dict[str, Any] = {"direct": _summary(_time_calls(lambda i: _weather("Oslo"), iterations))}
    disk = DiskStore(directory)
    rows |= _tool_rows("disk", disk, iterations)
    if redis_url is not None:
        from agentcache.cache.redis import RedisStore

        redis_store = RedisStore(redis_url, namespace=f"agentcache-bench-{time.time_ns()}")
        try:
            rows |= _tool_rows("redis", redis_store, iterations)
        finally:
            redis_store.clear()
            redis_store.close()
    rows |= _tool_rows("memory", MemoryStore(), iterations)
    rows |= _retrieval_row(disk, iterations)
    direct = rows["direct"]["p50_ms"]
    overhead = {f"{name}_overhead_p50_ms": rows[name]["p50_ms"] - direct for name in rows}
    del overhead["direct_overhead_p50_ms"]
    hit_ok = rows["disk_hit"]["p50_ms"] <= HIT_P50_TARGET_MS
    return {"iterations": iterations, "rows": rows, "overhead": overhead, "disk_hit_p50_ok": hit_ok}


@contextlib.contextmanager
def _redis(store: str, url: str | None) -> Iterator[str | None]:
    """The Redis url to measure: given, from the environment, or a private loopback server."""
    if store != "redis":
        yield None
        return
    url = url or env.redis_url()
    if url is not None:
        yield url
        return
    from agentcache.cache._redis_server import LocalRedisServer

    with LocalRedisServer() as local_url:
        yield local_url


def _unusable_dir(folder: Path) -> str | None:
    """Why ``folder`` cannot hold a DiskStore (a file on its path), or None."""
    blocker = file_on_path(folder)
    return None if blocker is None else f"{str(blocker)!r} is a file, not a folder"


def main(argv: list[str]) -> int:
    """Entry point of ``agentcache bench cache``; prints a table (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(prog="agentcache bench cache", description=DESCRIPTION)
    parser.add_argument(
        "--iterations", type=positive_int, default=2000, help="calls per measurement (default 2000)"
    )
    parser.add_argument("--dir", default=None, help="DiskStore folder (default: a temp folder)")
    parser.add_argument(
        "--store",
        choices=("disk", "redis"),
        default="disk",
        help="redis: also measure RedisStore (default: disk and memory only)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis for --store redis (default AGENTCACHE_REDIS_URL, else a private redis-server "
        "on a free loopback port)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if args.iterations < 10:
        parser.error("--iterations must be at least 10")
    if args.dir is not None and (problem := _unusable_dir(Path(args.dir))) is not None:
        print(f"agentcache bench cache: --dir {args.dir!r}: {problem}", file=sys.stderr)
        return 2
    try:
        with (
            tempfile.TemporaryDirectory(prefix="agentcache-bench-") as tmp,
            _redis(args.store, args.redis_url) as redis_url,
        ):
            report = run(args.iterations, args.dir or tmp, redis_url=redis_url)
    except FileNotFoundError as exc:
        print(f"agentcache bench cache: {exc}")
        return 2
    except CacheError as exc:
        print(f"agentcache bench cache: --dir {args.dir!r}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentcache bench cache: interrupted", file=sys.stderr)
        return 130
    print(f"{'measurement':22s} {'p50 ms':>9s} {'p99 ms':>9s} {'p50 over direct':>16s}")
    for name, row in report["rows"].items():
        extra = report["overhead"].get(f"{name}_overhead_p50_ms")
        over = "" if extra is None else f"{extra:+.4f}"
        print(f"{name:22s} {row['p50_ms']:9.4f} {row['p99_ms']:9.4f} {over:>16s}")
    verdict = "ok" if report["disk_hit_p50_ok"] else "MISSED"
    print(f"disk hit p50 target <= {HIT_P50_TARGET_MS} ms: {verdict}")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0
