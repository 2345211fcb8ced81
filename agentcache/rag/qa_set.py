"""The grounded-QA set that ships with agentcache: made-up facts, questions, exact answers.

``qa_set.json`` holds short documents of invented facts (so no model's pretraining can answer
them) and questions, each with the answer strings accepted and the ids of the documents that hold
the fact. ``answer_matches`` is the scoring rule of ``agentcache bench qa``. Knows nothing about
models, prompts or retrieval.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agentcache.rag.chunking import TextSource

__all__ = ["QaQuestion", "QaSet", "answer_matches", "fact_tokens", "load_qa_set"]

_NUMBER_COMMA = re.compile(r"(?<=\d),(?=\d{3}\b)")
_TOKEN = re.compile(r"[a-z0-9]+(?:\.[0-9]+)*")


@dataclass(frozen=True, slots=True)
class QaQuestion:
    """One question of the set."""

    question: str
    answers: tuple[str, ...]
    """Accepted answers; an answer counts when one of them appears in it (``answer_matches``)."""
    documents: tuple[str, ...]
    """Ids of the documents that hold the fact (``TextSource.source`` of ``QaSet.documents``)."""


@dataclass(frozen=True, slots=True)
class QaSet:
    """Documents and questions, as loaded and checked by ``load_qa_set``."""

    documents: tuple[TextSource, ...]
    """One ``TextSource`` per document; ``source`` is the document id."""
    questions: tuple[QaQuestion, ...]


def fact_tokens(text: str) -> tuple[str, ...]:
    """``text`` as lower-case word and number tokens: ``"18,400 People."`` -> ``("18400",
    "people")``; a decimal point inside a number stays (``"2.6"``), other punctuation splits."""
    return tuple(_TOKEN.findall(_NUMBER_COMMA.sub("", text.lower())))


def answer_matches(answer: str, accepted: tuple[str, ...] | list[str]) -> bool:
    """True when the tokens of one accepted answer occur, in order and adjacent, in ``answer``.

    ``"The lighthouse is 38 meters tall."`` matches ``("38 meters",)``; ``"1748"`` does not match
    ``("1742",)``. The rule of exact-fact QA scoring (a contained normalized answer, as SQuAD's
    exact match normalizes case and punctuation), loose on wording, strict on the fact.
    """
    words = fact_tokens(answer)
    for option in accepted:
        needle = fact_tokens(option)
        n = len(needle)
        if n and any(words[i : i + n] == needle for i in range(len(words) - n + 1)):
            return True
    return False


def load_qa_set(path: str | Path | None = None) -> QaSet:
    """Read and check a QA set (default: the one shipped as ``agentcache/rag/qa_set.json``).

    Raises:
        OSError: the file cannot be read.
        ValueError: not valid JSON, a field is missing or of the wrong type, document ids repeat,
            a question names a document that is not in the set, or none of its accepted
            answers occurs in its documents (the set would score a fact it never states).
    """
    if path is None:
        text = resources.files("agentcache.rag").joinpath("qa_set.json").read_text("utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    try:
        raw = json.loads(text)
        documents = tuple(TextSource(str(d["id"]), str(d["text"])) for d in raw["documents"])
        questions = tuple(_question(q) for q in raw["questions"])
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"QA set {str(path or 'qa_set.json')!r} is malformed: {exc!r}") from exc
    _check(documents, questions)
    return QaSet(documents, questions)


def _question(raw: Any) -> QaQuestion:
    answers, documents = raw["answers"], raw["documents"]
    if not isinstance(answers, list) or not isinstance(documents, list):
        raise TypeError(f"answers and documents must be lists in {raw!r}")
    return QaQuestion(str(raw["question"]), tuple(map(str, answers)), tuple(map(str, documents)))


def _check(documents: tuple[TextSource, ...], questions: tuple[QaQuestion, ...]) -> None:
    by_id = {d.source: d.text for d in documents}
    if len(by_id) != len(documents):
        raise ValueError("QA set document ids repeat")
    for q in questions:
        unknown = [d for d in q.documents if d not in by_id]
        if unknown or not q.documents or not q.answers:
            raise ValueError(f"question {q.question!r}: no answers, or unknown documents {unknown}")
        if not answer_matches(" ".join(by_id[d] for d in q.documents), q.answers):
            raise ValueError(f"question {q.question!r}: no accepted answer is in its documents")
