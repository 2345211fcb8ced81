"""On-disk ``CacheStore`` built on diskcache (SQLite in WAL mode plus value files), shared safely by
threads and processes that open the same directory.

Each value is wrapped in the checksummed envelope of ``_envelope``, so a damaged entry is
detected and dropped instead of returned. A vanished directory is recreated and a damaged
database moved aside for inspection (bounded), its entries that still read back whole copied
into the new one first (``_salvage``), each with a ``CacheRecoveryWarning``; a folder on a
network filesystem gets a ``NetworkFilesystemWarning``. Knows nothing about what the bytes mean.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple, TypeVar

import diskcache

from agentcache.cache._envelope import open_envelope, pack, unpack
from agentcache.cache._fs import network_filesystem
from agentcache.cache._salvage import readable_entries
from agentcache.cache.base import (
    CacheRecoveryWarning,
    CacheStats,
    CacheWarning,
    Clock,
    NetworkFilesystemWarning,
    validate_size_limit,
    validate_ttl,
)
from agentcache.exceptions import CacheError, CacheIntegrityError

__all__ = ["DiskStore", "file_on_path"]

T = TypeVar("T")

_DEFAULT_SIZE_LIMIT = 512 * 1024 * 1024
_DB_NAME = "cache.db"  # NOTE: diskcache.core.DBNAME; the -wal/-shm files sit next to it.
_VALUE_DIR = re.compile(r"^[0-9a-f]{2}$")  # diskcache's value-file folders (two hex digits)
_TRANSIENT = ("locked", "busy")  # sqlite OperationalError texts that are contention, not damage
_DAMAGED = f"{_DB_NAME}.damaged-"  # NOTE: + UTC stamp; its -wal/-shm keep SQLite's suffixes
MAX_QUARANTINED = 3
"""Damaged databases kept next to the cache for inspection; older ones are deleted."""
_warned_network: set[str] = set()  # folders already warned about (once per process)
_warned_lock = threading.Lock()


class _Handle(NamedTuple):
    cache: diskcache.Cache
    file_id: tuple[int, int] | None  # (st_dev, st_ino) of cache.db when opened


def file_on_path(folder: Path) -> Path | None:
    """The first of ``folder`` and the folders above it that exists as a file, or None.

    Such a path can never become a cache directory; checking takes microseconds (``stat``).
    """
    return next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)


class DiskStore:
    """Persistent ``CacheStore`` in ``directory``; safe across threads and processes.

    Eviction is least-recently-stored (diskcache's default) so that a hit is a pure read: readers
    in other processes never contend for the write lock. SQLite runs in WAL mode with
    ``synchronous=NORMAL``, so a process killed mid-write leaves the last committed state readable.

    Args:
        directory: Cache folder; created if missing. Only files diskcache creates there
            (``cache.db*`` and two-hex-digit value folders) are ever deleted or moved. A
            damaged database is renamed ``cache.db.damaged-<UTC stamp>`` (its ``-wal``/``-shm``
            alongside, so SQLite opens it as it was) and the newest ``MAX_QUARANTINED`` such
            copies are kept. Every entry of it that still reads back whole (not on a damaged
            page, its envelope's checksum intact, not expired) is copied into the new database
            first, unless that one already has the key; then the damaged database's value
            files (entries over 32 kB) are deleted.
        size_limit_bytes: Budget for the on-disk size, SQLite pages included (default 512 MiB).
            diskcache culls at most 10 entries per write, so the size can briefly overshoot.
        clock: Time source for TTLs, seconds since the epoch (default ``time.time``).
        timeout_s: How long one SQLite operation waits for another process's lock (default 10 s);
            on timeout the read answers a miss / the write is skipped, with a ``CacheWarning``.
        allow_network_fs: Do not warn when ``directory`` is on a network filesystem (NFS, SMB,
            sshfs, Ceph...: see ``_fs.NETWORK_FS_TYPES``), where SQLite's locking is unsafe
            and concurrent writers can corrupt the database. Linux only (read from
            ``/proc/self/mountinfo``); the warning comes once per folder and process.

    Raises:
        ValueError: ``size_limit_bytes`` is not a positive int.
        CacheError: ``directory`` is an existing file, or the directory cannot be created or
            opened even after recreating it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        size_limit_bytes: int = _DEFAULT_SIZE_LIMIT,
        clock: Clock = time.time,
        timeout_s: float = 10.0,
        allow_network_fs: bool = False,
    ) -> None:
        validate_size_limit(size_limit_bytes)
        self.directory = Path(directory)
        blocker = file_on_path(self.directory)
        if blocker is not None:
            where = "" if blocker == self.directory else f": {str(blocker)!r}"
            raise CacheError(
                f"cache directory {str(self.directory)!r}{where} is a file, not a directory; "
                "pass a folder path (it is created if missing)"
            )
        self._db_path = os.path.join(str(self.directory), _DB_NAME)  # str: stat() on every call
        self.size_limit_bytes = size_limit_bytes
        self._clock = clock
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # guards reopening and the counters
        self._hits = 0
        self._misses = 0
        if not allow_network_fs:
            _warn_if_network(self.directory)
        try:
            self._handle = self._connect()
        except (sqlite3.DatabaseError, OSError) as exc:
            moved = self._replace_damaged()
            _warn_recovered(f"cache at {str(self.directory)!r} was unreadable ({exc}); {moved}")

    def get(self, key: str) -> bytes | None:
        """See ``CacheStore.get``. A hit does not change eviction order (least-recently-stored)."""
        raw = self._call(lambda cache: cache.get(key, default=None), None)
        value = None if raw is None else self._open(key, raw)
        with self._lock:
            if value is None:
                self._misses += 1
            else:
                self._hits += 1
        return value

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        """See ``CacheStore.set``."""
        validate_ttl(ttl_s)
        expire_at = 0.0 if ttl_s is None else self._clock() + ttl_s
        envelope = pack(key, expire_at, value)
        if len(envelope) > self.size_limit_bytes:
            self.delete(key)
            return
        self._call(lambda cache: cache.set(key, envelope, expire=ttl_s), None)

    def delete(self, key: str) -> bool:
        """See ``CacheStore.delete``."""
        return bool(self._call(lambda cache: cache.delete(key), False))

    def clear(self) -> None:
        """See ``CacheStore.clear``."""
        self._call(lambda cache: cache.clear(), 0)

    def stats(self) -> CacheStats:
        """See ``CacheStore.stats``; ``entries`` and ``bytes`` cover every process's entries."""
        entries = int(self._call(len, 0))
        num_bytes = int(self._call(lambda cache: cache.volume(), 0))
        with self._lock:
            return CacheStats(self._hits, self._misses, entries, num_bytes)

    def check_integrity(self) -> None:
        """Run SQLite's integrity check, diskcache's file check and every entry's checksum.

        Orphan value files and empty value folders (left by a writer killed mid-``set`` or
        mid-cleanup) are not damage and pass.

        Reads every entry: O(entries); meant for tests and post-mortems.

        Raises:
            CacheIntegrityError: the database, a value file or an envelope is damaged.
        """
        cache = self._current().cache
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                found = cache.check(fix=False, retry=True)
            # NOTE: a writer killed between writing a value file and committing its row leaves an
            # orphan file; one killed after creating a value folder but before opening its file,
            # or after deleting a replaced file but before removing its folder, leaves an empty
            # folder. Both are wasted space (diskcache's check(fix=True) removes them), never
            # wrong data: a committed row whose file is missing is still "file not found".
            harmless = (diskcache.UnknownFileWarning, diskcache.EmptyDirWarning)
            problems = [str(w.message) for w in found if not issubclass(w.category, harmless)]
            for key in cache.iterkeys():
                raw = cache.get(key, default=None)
                if raw is not None and unpack(key, raw) is None:
                    problems.append(f"entry {key!r} fails its checksum")
        except (sqlite3.DatabaseError, OSError) as exc:
            raise CacheIntegrityError(f"cache at {str(self.directory)!r}: {exc}") from exc
        if problems:
            raise CacheIntegrityError(f"cache at {str(self.directory)!r}: {'; '.join(problems)}")

    def close(self) -> None:
        """Close this thread's database connection (see ``CacheStore.close``)."""
        self._handle.cache.close()

    # -- internals -------------------------------------------------------------------------------

    def _file_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._db_path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _connect(self) -> _Handle:
        self.directory.mkdir(parents=True, exist_ok=True)
        cache = diskcache.Cache(
            str(self.directory),
            timeout=self._timeout_s,
            size_limit=self.size_limit_bytes,
            eviction_policy="least-recently-stored",
            statistics=0,
            tag_index=0,
        )
        return _Handle(cache, self._file_id())

    def _connect_or_raise(self) -> _Handle:
        try:
            return self._connect()
        except (sqlite3.DatabaseError, OSError) as exc:
            raise CacheError(f"cannot open cache directory {str(self.directory)!r}: {exc}") from exc

    def _current(self) -> _Handle:
        """The open handle, reopened first if cache.db vanished or another process replaced it."""
        handle = self._handle
        file_id = self._file_id()
        if file_id is not None and file_id == handle.file_id:
            return handle
        with self._lock:
            if self._handle is not handle:
                return self._handle
            _close_quietly(handle.cache)
            self._handle = self._connect_or_raise()
        if file_id is None:  # NOTE: a replaced file is another process's recovery; it warned.
            _warn_recovered(f"cache at {str(self.directory)!r} disappeared; recreated it empty")
        return self._handle

    def _call(self, op: Callable[[diskcache.Cache], T], default: T) -> T:
        handle = self._current()
        try:
            return op(handle.cache)
        except diskcache.Timeout:
            warnings.warn(f"cache at {str(self.directory)!r} busy; skipped", CacheWarning, 3)
        except sqlite3.OperationalError as exc:
            if any(word in str(exc) for word in _TRANSIENT):
                warnings.warn(f"cache {str(self.directory)!r}: {exc}; skipped", CacheWarning, 3)
            else:
                self._recover(handle, exc)
        except (sqlite3.DatabaseError, OSError) as exc:
            self._recover(handle, exc)
        return default

    def _recover(self, handle: _Handle, exc: BaseException) -> None:
        with self._lock:
            if self._handle is not handle:
                return  # another thread already recovered
            _close_quietly(handle.cache)
            if self._file_id() not in (None, handle.file_id):
                moved = "reopened another process's new one"
                self._handle = self._connect_or_raise()
            else:
                moved = self._replace_damaged()
        _warn_recovered(f"cache at {str(self.directory)!r} was damaged ({exc}); {moved}")

    def _replace_damaged(self) -> str:
        """Move the damaged database aside, open a new one, copy in what still reads back
        whole, then delete the damaged one's value files and keep the newest copies.

        Returns:
            What happened, for the warning (names the copy and how many entries it gave).

        Raises:
            CacheError: the new database cannot be opened.
        """
        copy = self._quarantine()
        old_files = _value_files(self.directory)
        self._handle = self._connect_or_raise()
        saved = 0 if copy is None else self._salvage(copy)
        for path in old_files:
            path.unlink(missing_ok=True)
        _remove_empty_value_dirs(self.directory)
        self._prune_quarantine()
        if copy is None:
            return "recreated it empty"
        return (
            f"moved it to {str(copy)!r} for inspection and recreated it with the {saved} "
            f"entries that still read back whole"
        )

    def _salvage(self, copy: Path) -> int:
        """Add the readable entries of the damaged database ``copy`` to the new one (a key the
        new one already holds, written since by another process, is kept). Best effort: an
        error of the new database ends it. Returns how many entries were added."""
        cache = self._handle.cache
        saved = 0
        entries = readable_entries(copy, self.directory, clock=self._clock, now=time.time())
        try:
            for entry in entries:
                expire = None if entry.expire_time is None else entry.expire_time - time.time()
                if expire is None or expire > 0:
                    saved += bool(cache.add(entry.key, entry.envelope, expire=expire))
        except (sqlite3.Error, OSError, diskcache.Timeout):
            pass  # NOTE: what was added stays; the new database is usable either way
        finally:
            entries.close()  # NOTE: closes the damaged database's connection now
        return saved

    def _quarantine(self) -> Path | None:
        """Move the damaged database (and its ``-wal``/``-shm``) aside.

        Returns:
            The copy's path, or None when there was no database file to move.
        """
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        target = self.directory / f"{_DAMAGED}{stamp}"
        while target.exists():  # NOTE: same microsecond; a suffix keeps names in time order
            target = target.with_name(f"{target.name}x")
        moved = False
        for suffix in ("", "-wal", "-shm"):
            source = self.directory / f"{_DB_NAME}{suffix}"
            try:
                source.rename(f"{target}{suffix}")
                moved = moved or suffix == ""
            except FileNotFoundError:
                pass
            except OSError:
                source.unlink(missing_ok=True)  # NOTE: cannot rename (e.g. read-only): as before
        return target if moved else None

    def _prune_quarantine(self) -> None:
        found = self.directory.glob(f"{_DAMAGED}*")
        copies = sorted(p for p in found if not p.name.endswith(("-wal", "-shm")))
        for old in copies[: max(0, len(copies) - MAX_QUARANTINED)]:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{old}{suffix}").unlink(missing_ok=True)

    def _open(self, key: str, raw: object) -> bytes | None:
        return open_envelope(key, raw, clock=self._clock, drop=self.delete)


def _value_files(directory: Path) -> list[Path]:
    """Every file under ``directory``'s value folders (diskcache's two-hex-digit ones)."""
    if not directory.is_dir():
        return []
    folders = [c for c in directory.iterdir() if c.is_dir() and _VALUE_DIR.match(c.name)]
    return [path for folder in folders for path in folder.rglob("*") if not path.is_dir()]


def _remove_empty_value_dirs(directory: Path) -> None:
    """Remove value folders (and their subfolders) left empty; others stay."""
    if not directory.is_dir():
        return
    for folder in directory.iterdir():
        if folder.is_dir() and _VALUE_DIR.match(folder.name):
            for sub in sorted(folder.rglob("*"), reverse=True):  # NOTE: deepest first
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                folder.rmdir()


def _close_quietly(cache: diskcache.Cache) -> None:
    try:
        cache.close()
    except (sqlite3.Error, OSError):
        pass


def _warn_recovered(message: str) -> None:
    warnings.warn(message, CacheRecoveryWarning, stacklevel=4)


def _warn_if_network(directory: Path) -> None:
    """Warn once per folder and process when ``directory`` is on a network filesystem."""
    fs_type = network_filesystem(directory)
    if fs_type is None:
        return
    folder = str(directory.resolve())
    with _warned_lock:
        if folder in _warned_network:
            return
        _warned_network.add(folder)
    warnings.warn(
        f"cache directory {folder!r} is on a network filesystem ({fs_type}): SQLite's file "
        "locking is unsafe there and concurrent writers can corrupt the cache; use a local "
        "folder, or RedisStore to share across machines (DiskStore(..., allow_network_fs=True) "
        "silences this)",
        NetworkFilesystemWarning,
        stacklevel=3,
    )
