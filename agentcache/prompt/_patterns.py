"""Detectors for volatile values (timestamps, dates, UUIDs, request ids, counters) in text.

Shared by ``lint`` (find them in stable segments) and ``diff`` (say what a changed span looks
like). Regular expressions only; this module knows nothing about segments.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["VolatileMatch", "describe_at", "find_volatile"]

_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "timestamp",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
        ),
    ),
    (
        "uuid",
        re.compile(
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
        ),
    ),
    ("date", re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b")),
    (
        "date",
        re.compile(
            r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2},? \d{4}\b"
        ),
    ),
    ("time", re.compile(r"\b\d{1,2}:\d{2}:\d{2}\b")),
    ("unix time", re.compile(r"\b1[5-9]\d{8}(?:\d{3})?\b")),
    (
        "request id",
        re.compile(
            r"\b(?:req|request|trace|span|session|run|msg|chatcmpl)[-_]?(?:id)?[-_:= ]+"
            r"[A-Za-z0-9][A-Za-z0-9_-]{7,}\b",
            re.IGNORECASE,
        ),
    ),
    (
        "counter",
        re.compile(
            r"\b(?:turn|request|attempt|iteration|retry|step|call)\s*(?:#|no\.?|number)?\s*\d+\b",
            re.IGNORECASE,
        ),
    ),
)


class VolatileMatch(NamedTuple):
    """A volatile-looking span: what it looks like and its character offsets."""

    kind: str
    start: int
    end: int


def find_volatile(text: str) -> list[VolatileMatch]:
    """Every volatile-looking span in ``text``, in order, without overlaps (first pattern wins)."""
    found: list[VolatileMatch] = []
    taken: list[tuple[int, int]] = []
    for kind, pattern in _PATTERNS:
        for m in pattern.finditer(text):
            if not any(m.start() < end and start < m.end() for start, end in taken):
                found.append(VolatileMatch(kind, m.start(), m.end()))
                taken.append((m.start(), m.end()))
    return sorted(found, key=lambda v: v.start)


def describe_at(text: str, offset: int) -> str | None:
    """What the value covering character ``offset`` of ``text`` looks like (e.g. "timestamp")."""
    for match in find_volatile(text):
        if match.start <= offset <= match.end:
            return match.kind
    return None
