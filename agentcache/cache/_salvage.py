"""What a damaged DiskStore database still holds: its entries that read back whole.

Reads diskcache's ``Cache`` table of a moved-aside ``cache.db`` (read-only, by rowid, stepping
over pages SQLite reports as damaged) and yields each entry whose envelope passes its checksum
and has not expired. It knows diskcache's table (``diskcache.core``: the ``Cache`` columns,
``MODE_RAW`` values inline, ``MODE_BINARY`` values in ``xx/yy/<hex>.val`` files) and nothing of
what the bytes mean; it never writes.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Generator, Iterator
from contextlib import closing
from pathlib import Path
from typing import NamedTuple

from agentcache.cache._envelope import unpack
from agentcache.cache.base import Clock

__all__ = ["SalvagedEntry", "readable_entries"]

_MODE_RAW = 1  # NOTE: diskcache.core.MODE_RAW: bytes under 32 kB, inline in ``value``
_MODE_BINARY = 2  # NOTE: diskcache.core.MODE_BINARY: bytes in a value file named ``filename``
_VALUE_FILE = re.compile(r"^[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val$")  # Disk.filename's shape
_MAX_ROWID = (1 << 63) - 1
_FIRST_FROM = "SELECT rowid FROM Cache WHERE rowid >= ? ORDER BY rowid LIMIT 1"
_ROW = "SELECT key, raw, expire_time, mode, filename, value FROM Cache WHERE rowid = ?"


class SalvagedEntry(NamedTuple):
    """One entry read back whole from a damaged database."""

    key: str
    envelope: bytes
    """The stored envelope (checksum verified), to store again as it is."""
    expire_time: float | None
    """diskcache's expiry in ``time.time()`` seconds, None for never."""


def readable_entries(
    db_path: Path, directory: Path, *, clock: Clock, now: float
) -> Generator[SalvagedEntry, None, None]:
    """The entries of the database at ``db_path`` that can still be read and verified.

    Args:
        db_path: a damaged ``cache.db`` (its ``-wal`` beside it is read too); opened read-only.
        directory: the cache folder its value files (``MODE_BINARY``) are relative to.
        clock: the store's clock, for the envelope's expiry (an expired entry is skipped).
        now: ``time.time()``, for diskcache's own expiry column.

    Yields:
        Entries in rowid order (diskcache's store order): each with a str key, a value read
        whole (inline or from its file) whose envelope passes its checksum, and not expired.
        A row on a damaged page, one whose value file is missing, and anything that does not
        check out are skipped. Nothing when the database cannot be opened at all.
    """
    try:
        conn = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return
    with closing(conn):
        for rowid in _readable_rowids(conn):
            entry = _entry(conn, rowid, directory)
            if entry is None or (entry.expire_time is not None and entry.expire_time <= now):
                continue
            verified = unpack(entry.key, entry.envelope)
            if verified is not None and not (verified[1] and verified[1] <= clock()):
                yield entry


def _readable_rowids(conn: sqlite3.Connection) -> Iterator[int]:
    """Every rowid of ``Cache`` that SQLite can reach, ascending, one query per row.

    NOTE: one seek per row (``rowid >= r``, which lands on the page that would hold r), not one
    scan: a scan stops at the first damaged b-tree page (and Python's cursor reads a row ahead,
    losing the readable row before it), and ``rowid > r`` first visits the page holding r.
    """
    start = 1  # NOTE: diskcache assigns rowids upwards from 1
    while True:
        try:
            found = _first_from(conn, start)
        except sqlite3.DatabaseError:
            found = _past_damage(conn, start)
        if found is None:
            return
        yield found
        start = found + 1


def _past_damage(conn: sqlite3.Connection, start: int) -> int | None:
    """The first readable rowid after ``start``, whose own seek SQLite cannot answer.

    Probes ``rowid >= start + 2**k`` (k = 0, 1, ...) until SQLite answers, then bisects back
    between the last failed and the first answered probe, so only the rows on damaged pages
    are skipped. None when no row past ``start`` can be read.
    """
    failed, step = start, 1
    while True:
        probe = min(start + step, _MAX_ROWID)
        if _answers(conn, probe):
            break
        if probe >= _MAX_ROWID:
            return None
        failed, step = probe, step * 2
    low, high = failed, probe  # NOTE: a seek from ``low`` fails, one from ``high`` answers
    while high - low > 1:
        middle = (low + high) // 2
        if _answers(conn, middle):
            high = middle
        else:
            low = middle
    try:
        return _first_from(conn, high)
    except sqlite3.DatabaseError:
        return None


def _first_from(conn: sqlite3.Connection, start: int) -> int | None:
    """The first rowid ``>= start``, None when there is none.

    Raises:
        sqlite3.DatabaseError: SQLite cannot read the page that holds it (or the way there).
    """
    row = conn.execute(_FIRST_FROM, (start,)).fetchone()
    return None if row is None else int(row[0])


def _answers(conn: sqlite3.Connection, start: int) -> bool:
    try:
        _first_from(conn, start)
    except sqlite3.DatabaseError:
        return False
    return True


def _entry(conn: sqlite3.Connection, rowid: int, directory: Path) -> SalvagedEntry | None:
    try:
        row = conn.execute(_ROW, (rowid,)).fetchone()
    except sqlite3.DatabaseError:
        return None
    if row is None:
        return None
    key, raw, expire_time, mode, filename, value = row
    if not (isinstance(key, str) and raw == 1):
        return None  # NOTE: DiskStore keys are str, stored raw
    if expire_time is not None and not isinstance(expire_time, float | int):
        return None
    envelope = _value(mode, filename, value, directory)
    if envelope is None:
        return None
    return SalvagedEntry(key, envelope, None if expire_time is None else float(expire_time))


def _value(mode: object, filename: object, value: object, directory: Path) -> bytes | None:
    if mode == _MODE_RAW and isinstance(value, bytes):
        return value
    if mode != _MODE_BINARY or not isinstance(filename, str) or not _VALUE_FILE.match(filename):
        return None  # NOTE: a name of another shape is damage; never read outside the folder
    try:
        return (directory / filename).read_bytes()
    except OSError:
        return None
