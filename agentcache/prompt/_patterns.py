"""Detectors for volatile values (timestamps, dates, UUIDs, request ids, counters) in text.

Shared by ``lint`` (find them in stable segments) and ``diff`` (say what a changed span looks
like). Regular expressions only; this module knows nothing about segments.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["VolatileMatch", "describe_at", "find_volatile"]

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_DAY_MONTH_YEAR = (
    rf"\b(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?(?: of)? {_MONTH}\.?,? (?:19|20)\d{{2}}\b"
)
"""``29 November 2026``, ``29 Nov 2026``, ``3rd of March, 2026``: day, month name, year."""

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
    ("date", re.compile(_DAY_MONTH_YEAR, re.IGNORECASE)),
    # NOTE: day.month.year with a four-digit 19xx/20xx year and a real day and month; a letter,
    # digit or dot right before it (``v10.12.2020``, ``1.10.12.2020``) makes it a version.
    (
        "date",
        re.compile(
            r"(?<![\w.])(?:0?[1-9]|[12]\d|3[01])\.(?:0?[1-9]|1[0-2])\.(?:19|20)\d{2}(?![\w]|\.\d)"
        ),
    ),
    # NOTE: clock times: a two-digit hour 00-23 with minutes 00-59 (``14:05``, ``09:30:15.2``), a
    # one-digit hour with seconds (``9:05:33``) or any hour with am/pm (``9:15 am``). Ratios and
    # verses (``3:2``, ``16:9``, ``3:16``) and colon runs (MAC addresses) stay out; a ratio like
    # ``16:10`` reads the same as a time and is flagged.
    (
        "time",
        re.compile(
            r"(?<![\w:.])(?:\d{1,2}:[0-5]\d(?::[0-5]\d)? ?[AaPp]\.?[Mm]\b"
            r"|(?:(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d)?|\d:[0-5]\d:[0-5]\d)(?:\.\d+)?"
            r"(?![\w:]|\.\d))"
        ),
    ),
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
