"""``agentcache bench qa``: the shipped QA set, its scoring rule, and a short run on ``tiny``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agentcache.cli import main
from agentcache.rag import DocumentIndex
from agentcache.rag.bench import MODES, ModeRecord, _agreement
from agentcache.rag.qa_set import answer_matches, fact_tokens, load_qa_set


def test_the_shipped_set_has_120_plus_questions_each_answered_in_its_document() -> None:
    """Enough questions that one flip is under a point (1/134), unique ids and questions, the
    first accepted answer (the document's own wording) in the question's document, and BM25 at
    the bench's k=3 finds every question's document."""
    qa = load_qa_set()  # NOTE: the loader refuses a question whose answer its documents lack
    assert len(qa.questions) >= 120 and len(qa.documents) >= 25
    by_id = {d.source: d.text for d in qa.documents}
    assert len(by_id) == len(qa.documents)
    assert len({q.question for q in qa.questions}) == len(qa.questions)
    for q in qa.questions:
        assert set(q.documents) <= set(by_id) and q.answers, q.question
        text = " ".join(by_id[d] for d in q.documents)
        assert answer_matches(text, q.answers[:1]), q.question
    # one chunk per document, so a retrieved chunk's source is the document id
    index = DocumentIndex.from_sources(qa.documents)
    assert sorted(c.source for c in index.chunks) == sorted(by_id)
    for q in qa.questions:
        found = {c.source for c in index.retrieve(q.question, 3)}
        assert set(q.documents) <= found, q.question


def test_the_first_52_questions_and_their_12_documents_are_unchanged() -> None:
    """Version 2 appended documents and questions to version 1's (retrieval now ranks the new
    documents too, so old questions' prompts can change). The digest is of version 1's documents
    and questions, in order."""
    qa = load_qa_set()
    old: list[object] = [[d.source, d.text] for d in qa.documents[:12]]
    old += [[q.question, list(q.answers), list(q.documents)] for q in qa.questions[:52]]
    digest = hashlib.sha256(json.dumps(old).encode()).hexdigest()
    assert digest == "8f2af06e2bd63a72328106d51cd9af84913f49ba0bffa396a9aaaa6f9248f24f"


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
    assert summary["cache_on_equals_cache_off"] is True and summary["kv_dtype"] == "float32"


def test_bench_qa_takes_a_kv_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    """``--kv-dtype float16`` runs every mode over an fp16 KV cache, and the summary names the
    KV dtype the engine resolved (``auto`` elsewhere: the model's float32)."""
    argv = ["--limit", "1", "--max-tokens", "2", "--skip-chunk-reuse", "--json"]
    assert main(["bench", "qa", "--model", "tiny", "--kv-dtype", "float16", *argv]) == 0
    (summary,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert summary["kv_dtype"] == "float16" and summary["cache_on_equals_cache_off"] is True


def test_agreement_counts_equal_answers_and_flips_question_by_question() -> None:
    ref = ModeRecord(token_ids=[[1, 2], [3], [4], [5, 6]], correct=[True, True, False, False])
    other = ModeRecord(token_ids=[[1, 2], [3, 9], [4], [5]], correct=[True, False, False, True])
    line = _agreement(ref, other)
    assert line["same_tokens_as_reference"] == 2 and line["agreement"] == 0.5
    assert line["right_to_wrong"] == [2] and line["wrong_to_right"] == [4]
    assert line["accuracy"] == 0.5


def test_bench_qa_compare_weights_reports_agreement_with_the_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--compare-weights`` adds a prefix-cache mode per weight type, on ``tiny`` models built
    in the run, and the one JSON line carries each one's agreement with float32."""
    argv = ["--limit", "3", "--max-tokens", "4", "--skip-chunk-reuse", "--json"]
    code = main(["bench", "qa", "--model", "tiny", *argv, "--compare-weights", "q8_0", "q4_1"])
    (summary,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and summary["weights"] == "float32"
    modes = [m["mode"] for m in summary["modes"]]
    assert modes == ["cache off", "prefix cache", "prefix cache q8_0", "prefix cache q4_1"]
    by_mode = {m["mode"]: m for m in summary["modes"]}
    comparison = summary["weights_comparison"]
    assert sorted(comparison) == ["q4_1", "q8_0"]
    for weights, line in comparison.items():
        mode = by_mode[f"prefix cache {weights}"]
        assert line["accuracy"] == mode["accuracy"] and 0 <= line["same_tokens_as_reference"] <= 3
        assert line["agreement"] == line["same_tokens_as_reference"] / 3
        # prefix cache equals cache off under float32, so agreeing with one is agreeing with both
        assert line["same_tokens_as_reference"] == mode["same_tokens_as_cache_off"]
        flips = len(line["wrong_to_right"]) - len(line["right_to_wrong"])
        assert line["accuracy"] - summary["accuracy"] == pytest.approx(flips / 3)


def test_bench_qa_refuses_comparing_the_reference_weights_with_themselves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for extra in (["--compare-weights", "float32"], ["--compare-weights", "q8_0", "q8_0"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "qa", "--model", "tiny", "--limit", "1", *extra])
        assert exc.value.code == 2
        assert "--compare-weights" in capsys.readouterr().err
