"""EmbeddingCache: keys by (model, revision, normalized text, scope); a rebuild embeds nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentcache.cache import DiskStore, MemoryStore, cache_scope
from agentcache.cache.embedding import EmbeddingCache
from agentcache.exceptions import BackendUnavailableError, ConfigError


class Embedder:
    """A deterministic stand-in model that counts the texts it embeds."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.texts += texts
        return np.array([[len(t), sum(map(ord, t)) % 97, 1.0] for t in texts], dtype=np.float32)


def test_only_missing_texts_are_embedded_and_vectors_round_trip(tmp_path: Path) -> None:
    model = Embedder()
    cache = EmbeddingCache(DiskStore(tmp_path / "e"), model_id="m", revision="r1")
    first = cache.get_or_embed(["a", "bb", "a"], model)
    assert model.texts == ["a", "bb"] and first.shape == (3, 3) and first.dtype == np.float32
    reopened = EmbeddingCache(DiskStore(tmp_path / "e"), model_id="m", revision="r1")
    again = reopened.get_or_embed(["bb", "a", "ccc"], model)
    assert model.texts == ["a", "bb", "ccc"]
    np.testing.assert_array_equal(again[:2], first[[1, 0]])
    assert reopened.stats().hits == 2 and reopened.stats().misses == 1


def test_model_revision_and_scope_are_part_of_the_key() -> None:
    store, model = MemoryStore(), Embedder()
    EmbeddingCache(store, model_id="m", revision="r1").get_or_embed(["x"], model)
    EmbeddingCache(store, model_id="m", revision="r2").get_or_embed(["x"], model)
    EmbeddingCache(store, model_id="other", revision="r1").get_or_embed(["x"], model)
    tenant_cache = EmbeddingCache(store, model_id="m", revision="r1")
    with cache_scope(tenant="a"):
        tenant_cache.get_or_embed(["x"], model)
    assert model.texts == ["x"] * 4
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    EmbeddingCache(store, model_id="m", revision="r1").get_or_embed([nfc, nfd], model)
    assert model.texts[4:] == [nfc]
    with pytest.raises(ConfigError, match="revision"):
        EmbeddingCache(store, model_id="m", revision="")


def test_a_rebuild_of_an_unchanged_corpus_embeds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    from agentcache.rag import DocumentIndex, TextSource
    from agentcache.rag.embed import EmbeddingRetriever

    docs = [TextSource(f"{n}.md", f"Notes about topic {n}: parsing, files, numbers.") for n in "ab"]
    docs.append(TextSource("csv.md", "The csv module reads comma separated files."))
    try:
        first = EmbeddingRetriever(cache=DiskStore(tmp_path / "emb"))
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    DocumentIndex.from_sources(docs, retriever=first)
    assert first.num_embedded == 3
    second = EmbeddingRetriever(cache=DiskStore(tmp_path / "emb"))  # a new process
    index = DocumentIndex.from_sources(docs, retriever=second)
    assert second.num_embedded == 0
    assert index.retriever.search("reading comma separated files", 1)[0].chunk.source == "csv.md"
    assert second.num_embedded == 1  # the query
    index.add_sources([TextSource("new.md", "A new note.")])
    assert second.num_embedded == 2
