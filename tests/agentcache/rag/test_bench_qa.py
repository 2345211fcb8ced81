"""``agentcache bench qa``: the shipped QA set, its scoring rule, and a short run on ``tiny``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentcache.cli import main
from agentcache.rag import DocumentIndex
from agentcache.rag.bench import MODES
from agentcache.rag.qa_set import answer_matches, fact_tokens, load_qa_set


def test_the_shipped_set_has_40_plus_questions_each_answered_in_its_document() -> None:
    qa = load_qa_set()  # NOTE: the loader refuses a question whose answer its documents lack
    assert len(qa.questions) >= 40 and len(qa.documents) >= 10
    ids = {d.source for d in qa.documents}
    assert all(set(q.documents) <= ids and q.answers for q in qa.questions)
    # one chunk per document, so a retrieved chunk's source is the document id
    index = DocumentIndex.from_sources(qa.documents)
    assert sorted(c.source for c in index.chunks) == sorted(ids)


def test_answer_matching_is_loose_on_wording_strict_on_the_fact() -> None:
    assert answer_matches("The Grey Lantern is 38 meters tall.", ("38 meters",))
    assert answer_matches("It seats 18400 people", ("18,400",))
    assert answer_matches("Files end in .brk", (".brk",))
    assert not answer_matches("It was founded in 1748.", ("1742",))
    assert not answer_matches("2.65 kilograms", ("2.6 kilograms",))
    assert not answer_matches("Odile", ("Odile Franck",))
    assert fact_tokens("Castellan's Gambit, 2.6 KG") == ("castellan", "s", "gambit", "2.6", "kg")


def test_a_question_whose_answer_is_not_in_its_document_is_refused(tmp_path: Path) -> None:
    bad = {
        "documents": [{"id": "a", "text": "The bridge was built in 1893."}],
        "questions": [{"question": "When?", "answers": ["1894"], "documents": ["a"]}],
    }
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(bad), encoding="utf-8")
    with pytest.raises(ValueError, match="no accepted answer is in its documents"):
        load_qa_set(path)
    path.write_text(json.dumps({"documents": []}), encoding="utf-8")
    with pytest.raises(ValueError, match="malformed"):
        load_qa_set(path)


def test_bench_qa_on_tiny_runs_every_mode_and_checks_cache_on_equals_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--limit", "3", "--max-tokens", "6", "--threads", "1", "--json"]
    code = main(["bench", "qa", "--model", "tiny", *argv])
    (summary,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    modes = summary["modes"]
    assert [m["mode"] for m in modes] == list(MODES)
    for m in modes:
        assert m["questions"] == 3 and 0.0 <= m["accuracy"] <= 1.0
        assert 3 <= m["completion_tokens"] <= 18  # the ids compared: 1 to 6 per answer
        assert m["ttft_ms_min"] <= m["ttft_ms_median"] <= m["ttft_ms_max"]
        assert m["answers_with_markup"] == 0
    by_mode = {m["mode"]: m for m in modes}
    assert by_mode["prefix cache"]["same_tokens_as_cache_off"] == 3
    assert by_mode["cache off"]["prefix_cached_share"] == 0.0
    assert by_mode["chunk blend"]["chunk_reused_share"] > 0.0  # documents recur across questions
    assert summary["summary"] is True and summary["weights"] == "float32"
    assert summary["cache_on_equals_cache_off"] is True
    assert summary["accuracy"] == by_mode["prefix cache"]["accuracy"]
    assert summary["accuracy"] == summary["cache_off_accuracy"]
    assert summary["retrieval_recall"] == 1.0 and summary["questions"] == 3


def test_bench_qa_skip_chunk_reuse_runs_only_cache_off_and_prefix_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--limit", "1", "--max-tokens", "2", "--skip-chunk-reuse", "--json"]
    assert main(["bench", "qa", "--model", "tiny", *argv]) == 0
    (summary,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [m["mode"] for m in summary["modes"]] == ["cache off", "prefix cache"]
    assert "chunk_blend_accuracy" not in summary and summary["cache_on_equals_cache_off"] is True


def test_bench_qa_takes_quantized_weights(capsys: pytest.CaptureFixture[str]) -> None:
    """``--weights q8_0`` runs a quantized engine (the tiny model's linear layers take 32-weight
    blocks) and the one JSON line names it next to the accuracy."""
    argv = ["--limit", "1", "--max-tokens", "2", "--skip-chunk-reuse", "--json"]
    assert main(["bench", "qa", "--model", "tiny", "--weights", "q8_0", *argv]) == 0
    (summary,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert summary["weights"] == "q8_0" and 0.0 <= summary["accuracy"] <= 1.0
    assert summary["cache_on_equals_cache_off"] is True
