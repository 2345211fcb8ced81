"""RAG: loading, stable chunk ids, BM25, stdlib corpus, retrieval cache and stable order."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentcache.cache import MemoryStore, RetrievalCache
from agentcache.exceptions import BackendUnavailableError, ConfigError
from agentcache.rag import (
    DocumentIndex,
    TextSource,
    chunk_sources,
    chunk_text,
    create_retriever,
    load_folder,
    stdlib_sources,
    to_sources,
)

DOCS = [
    TextSource("json.md", "json.loads parses a JSON document from a string.\n\nUse json.dumps."),
    TextSource("csv.md", "The csv module reads and writes comma separated values."),
    TextSource("re.md", "re.compile builds a regular expression pattern object."),
    TextSource("pathlib.md", "pathlib.Path represents filesystem paths; Path.read_text reads."),
]


def test_chunk_ids_are_content_derived_and_stable() -> None:
    a, b = chunk_sources(DOCS), chunk_sources(list(DOCS))
    assert [c.id for c in a] == [c.id for c in b] and len({c.id for c in a}) == len(a)
    edited = chunk_sources([TextSource("json.md", "changed"), *DOCS[1:]])
    assert edited[0].id != a[0].id and [c.id for c in edited[1:]] == [c.id for c in a[1:]]


def test_chunk_text_packs_paragraphs_under_the_limit() -> None:
    text = "\n\n".join(f"paragraph {i} " + "word " * 30 for i in range(10))
    pieces = chunk_text(text, max_chars=400)
    assert all(len(p) <= 400 for p in pieces) and len(pieces) > 1
    assert pieces[0].startswith("paragraph 0") and pieces[-1].startswith("paragraph")
    assert chunk_text("x" * 1000, max_chars=100) == ["x" * 100] * 10


def test_load_folder_sorted_and_filtered(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("bee")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("print(1)")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "c.txt").write_text("no")
    assert load_folder(tmp_path) == [TextSource("b.md", "bee"), TextSource("sub/a.py", "print(1)")]
    with pytest.raises(ConfigError, match="does not exist"):
        load_folder(tmp_path / "missing")


def test_to_sources_accepts_several_shapes() -> None:
    class Doc:
        id = "d9"
        text = "t"

    got = to_sources(["plain", ("s", "t"), Doc()])
    assert got == [TextSource("doc-0", "plain"), TextSource("s", "t"), TextSource("d9", "t")]
    with pytest.raises(TypeError):
        to_sources([42])


def test_bm25_finds_the_right_chunk_and_orders_by_id() -> None:
    index = DocumentIndex.from_sources(DOCS)
    hits = index.retriever.search("how to parse json string", 2)
    assert hits[0].chunk.source == "json.md"
    chunks = index.retrieve("regular expression csv module", k=3)
    assert [c.id for c in chunks] == sorted(c.id for c in chunks)
    assert {c.source for c in chunks} >= {"re.md", "csv.md"}
    assert index.retrieve("zzzz unknownword", k=3) == []


def test_retrieval_cache_hits_on_repeat_and_new_index_rekeys() -> None:
    cache = RetrievalCache(MemoryStore())
    index = DocumentIndex.from_sources(DOCS, cache=cache)
    first = index.retrieve("json loads", k=2)
    again = index.retrieve("json loads", k=2)
    assert first == again and (cache.stats().hits, cache.stats().misses) == (1, 1)
    other = DocumentIndex.from_sources(DOCS[:3], cache=cache)
    assert other.fingerprint != index.fingerprint
    other.retrieve("json loads", k=2)
    assert cache.stats().misses == 2


def test_search_tool_has_a_docstring_schema_and_formats_ids() -> None:
    tool = DocumentIndex.from_sources(DOCS).search_tool(k=1)
    out = tool("pathlib read_text")
    assert tool.__name__ == "search_docs" and "(pathlib.md)" in out and out.startswith("[")


def test_stdlib_corpus_is_real_bounded_and_deterministic() -> None:
    seen: list[tuple[int, int]] = []
    a = stdlib_sources(max_files=30, progress=lambda d, t: seen.append((d, t)))
    b = stdlib_sources(max_files=30)
    assert a == b and len(a) > 20 and seen[-1][0] == len(seen)
    assert all(not s.source.split(":")[0].split(".")[-1].startswith("_") for s in a)
    small = stdlib_sources(max_files=30, max_chars=1000)
    assert small == a[: len(small)] and len(small) < len(a)


def test_retriever_registry() -> None:
    assert create_retriever("bm25").retriever_id == "bm25"
    with pytest.raises(ConfigError, match="valid names: bm25, embed"):
        create_retriever("tfidf")


def test_embedding_retriever_when_installed() -> None:
    pytest.importorskip("sentence_transformers")
    try:
        retriever = create_retriever("embed")
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    index = DocumentIndex.from_sources(DOCS, retriever=retriever)
    assert index.retriever.search("reading comma separated files", 1)[0].chunk.source == "csv.md"


def test_load_folder_skips_empty_and_undecodable_files_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "blank.md").write_text(" \n\t")
    (tmp_path / "big.md").write_text("x" * 50)
    (tmp_path / "ok.md").write_text("Some text.")
    skipped: list[tuple[str, str]] = []
    sources = load_folder(tmp_path, max_file_bytes=20, on_skip=lambda n, r: skipped.append((n, r)))
    assert [s.source for s in sources] == ["ok.md"]
    assert skipped == [
        ("bad.txt", "not valid UTF-8"),
        ("big.md", "larger than 20 bytes"),
        ("blank.md", "empty"),
    ]
