"""RetrievalCache and index_fingerprint: invalidation, normalization, order, scope."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from agentcache.cache import (
    CacheScopeError,
    MemoryStore,
    RetrievalCache,
    cache_scope,
    index_fingerprint,
    normalize_query,
)


@dataclass(frozen=True, slots=True)
class Hit:
    chunk_id: str
    score: float


CORPUS = [("a#0", "Prefix caching reuses KV."), ("b#0", "BM25 ranks by term overlap.")]


def retrieve_all(
    cache: RetrievalCache, query: str, fingerprint: str, calls: list[str]
) -> list[Hit]:
    def compute() -> list[Hit]:
        calls.append(query)
        return [Hit("b#0", 2.5), Hit("a#0", 0.75)]

    return cache.get_or_compute(
        retriever_id="bm25", index_fingerprint=fingerprint, query=query, k=2, compute=compute
    )


def test_index_fingerprint_tracks_contents_settings_and_order() -> None:
    base = index_fingerprint(CORPUS, chunk_size=200, overlap=20)
    assert base == index_fingerprint(list(CORPUS), overlap=20, chunk_size=200)
    assert len(base) == 64
    changed_text = [CORPUS[0], ("b#0", "BM25 ranks by term overlap!")]
    assert index_fingerprint(changed_text, chunk_size=200, overlap=20) != base
    assert index_fingerprint(CORPUS, chunk_size=201, overlap=20) != base
    assert index_fingerprint(CORPUS[::-1], chunk_size=200, overlap=20) != base
    assert index_fingerprint([("a#0a", "b"), ("", "")]) != index_fingerprint([("a#0", "ab")])
    with pytest.raises(TypeError, match="chunk #0"):
        index_fingerprint([("id", 3)])  # type: ignore[list-item]


def test_hits_keep_results_equal_and_ordered() -> None:
    cache, calls = RetrievalCache(MemoryStore()), list[str]()
    fp = index_fingerprint(CORPUS)
    first = retrieve_all(cache, "kv cache", fp, calls)
    second = retrieve_all(cache, "kv cache", fp, calls)
    assert second == first == [Hit("b#0", 2.5), Hit("a#0", 0.75)]
    assert all(type(h) is Hit for h in second)
    assert calls == ["kv cache"]
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.hit_rate) == (1, 1, 0.5)


def test_reindexing_a_changed_corpus_invalidates() -> None:
    cache, calls = RetrievalCache(MemoryStore()), list[str]()
    retrieve_all(cache, "q", index_fingerprint(CORPUS), calls)
    edited = [*CORPUS, ("c#0", "A new document.")]
    retrieve_all(cache, "q", index_fingerprint(edited), calls)
    retrieve_all(cache, "q", index_fingerprint(CORPUS), calls)
    assert calls == ["q", "q"]


def test_query_normalization() -> None:
    assert normalize_query("  kv\tcache \n reuse ") == "kv cache reuse"
    assert normalize_query("Cafe\u0301") == "Caf\u00e9"  # NFC
    assert normalize_query("KV Cache") == "KV Cache"
    assert normalize_query("KV Cache", casefold=True) == "kv cache"
    cache, calls = RetrievalCache(MemoryStore()), list[str]()
    fp = index_fingerprint(CORPUS)
    retrieve_all(cache, "kv  cache", fp, calls)
    retrieve_all(cache, " kv cache ", fp, calls)
    retrieve_all(cache, "KV cache", fp, calls)
    assert calls == ["kv  cache", "KV cache"]
    folding, folded_calls = RetrievalCache(MemoryStore(), casefold_queries=True), list[str]()
    retrieve_all(folding, "kv cache", fp, folded_calls)
    retrieve_all(folding, "KV CACHE", fp, folded_calls)
    assert folded_calls == ["kv cache"]


def test_k_and_filters_are_part_of_the_key() -> None:
    cache = RetrievalCache(MemoryStore())
    calls: list[tuple[int, object]] = []

    def get(k: int, filters: dict[str, object] | None) -> list[str]:
        def compute() -> list[str]:
            calls.append((k, filters))
            return ["x"] * k

        return cache.get_or_compute(
            retriever_id="r",
            index_fingerprint="fp",
            query="q",
            k=k,
            filters=filters,
            compute=compute,
        )

    get(2, None)
    get(3, None)
    get(3, {"lang": "en", "year": 2024})
    get(3, {"year": 2024, "lang": "en"})  # key order does not matter
    get(3, {"year": 2025, "lang": "en"})
    assert len(calls) == 4
    with pytest.raises(ValueError, match="k must be"):
        get(0, None)


def test_tenant_scoped_retrieval_is_isolated() -> None:
    cache, calls = RetrievalCache(MemoryStore(), scope="tenant"), list[str]()
    fp = index_fingerprint(CORPUS)
    with pytest.raises(CacheScopeError, match="tenant"):
        retrieve_all(cache, "q", fp, calls)
    with cache_scope(tenant="a"):
        retrieve_all(cache, "q", fp, calls)
        retrieve_all(cache, "q", fp, calls)
    with cache_scope(tenant="b"):
        retrieve_all(cache, "q", fp, calls)
    assert calls == ["q", "q"]


def test_bench_cache_runs_and_ends_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from agentcache.cache.bench import main

    assert main(["--iterations", "20", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["rows"]) == {
        "direct",
        "disk_miss",
        "disk_hit",
        "memory_miss",
        "memory_hit",
        "disk_retrieval_hit",
    }
    assert all(row["p99_ms"] >= row["p50_ms"] > 0 for row in report["rows"].values())


def test_bench_cache_store_redis_adds_redis_rows(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from agentcache.cache.bench import main

    assert main(["--iterations", "20", "--store", "redis", "--redis-url", redis_url, "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert {"redis_miss", "redis_hit", "disk_miss", "disk_hit"} <= set(report["rows"])
    assert all(row["p99_ms"] >= row["p50_ms"] > 0 for row in report["rows"].values())
    assert any(line.startswith("redis_hit ") for line in out.splitlines())


def test_bench_cache_dir_on_a_file_exits_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentcache.cache.bench import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    for folder in (blocker, blocker / "sub"):
        assert main(["--iterations", "20", "--dir", str(folder)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "Traceback" not in captured.err
        assert captured.err.strip().endswith(f"{str(blocker)!r} is a file, not a folder")
