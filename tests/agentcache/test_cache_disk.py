"""DiskStore resilience: vanished or corrupt directories, damaged entries, several processes,
and a writer killed mid-write."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sqlite3
import time
from contextlib import closing
from multiprocessing.synchronize import Barrier as BarrierType
from pathlib import Path

import pytest

from agentcache.cache import CacheIntegrityError, CacheRecoveryWarning, DiskStore, ToolCache
from agentcache.cache.disk import MAX_QUARANTINED


def test_directory_deleted_while_in_use(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    calls: list[int] = []

    def tool_fn(x: int) -> dict[str, int]:
        calls.append(x)
        return {"x": x}

    tool = ToolCache(store).wrap(tool_fn, name="t")
    assert tool(1) == {"x": 1}
    shutil.rmtree(tmp_path / "c")
    with pytest.warns(CacheRecoveryWarning, match="disappeared"):
        assert tool(1) == {"x": 1}  # the real result, from running the tool again
    assert tool(1) == {"x": 1}
    assert calls == [1, 1]
    assert (tmp_path / "c" / "cache.db").exists()
    store.check_integrity()


def test_database_corrupted_while_in_use(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.set("k", b"v")
    store.close()  # NOTE: a fresh connection must read the damaged header
    (tmp_path / "c" / "cache.db").write_bytes(b"this is not a database" * 100)
    for suffix in ("-wal", "-shm"):
        (tmp_path / "c" / f"cache.db{suffix}").unlink(missing_ok=True)
    with pytest.warns(CacheRecoveryWarning, match="damaged"):
        assert store.get("k") is None
    store.set("k", b"v2")
    assert store.get("k") == b"v2"
    store.check_integrity()


def test_corrupt_database_at_open_is_recreated(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "cache.db").write_bytes(b"\x00garbage" * 500)
    (folder / "keep.txt").write_text("user file")
    with pytest.warns(CacheRecoveryWarning, match="unreadable") as record:
        store = DiskStore(folder)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert (folder / "keep.txt").read_text() == "user file"  # only diskcache's files are removed
    (copy,) = folder.glob("cache.db.damaged-*")
    assert copy.read_bytes() == b"\x00garbage" * 500  # kept for inspection, byte for byte
    assert str(copy) in str(record[0].message)


def test_database_damaged_in_use_is_moved_aside_and_named(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    store = DiskStore(folder)
    store.set("k", b"v")
    store.close()
    damaged = b"this is not a database" * 100
    (folder / "cache.db").write_bytes(damaged)
    for suffix in ("-wal", "-shm"):
        (folder / f"cache.db{suffix}").unlink(missing_ok=True)
    with pytest.warns(CacheRecoveryWarning, match="damaged") as record:
        assert store.get("k") is None
    (copy,) = (p for p in folder.glob("cache.db.damaged-*") if p.name[-4:] not in ("-wal", "-shm"))
    assert copy.read_bytes() == damaged
    assert f"moved it to {str(copy)!r}" in str(record[0].message)
    store.set("k", b"v2")
    assert store.get("k") == b"v2"
    store.check_integrity()


def test_at_most_three_damaged_copies_are_kept_the_newest(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    for i in range(5):
        (folder / "cache.db").write_bytes(f"damage number {i} ".encode() * 200)
        with pytest.warns(CacheRecoveryWarning, match="unreadable"):
            DiskStore(folder).close()
    copies = sorted(folder.glob("cache.db.damaged-*"))
    assert len(copies) == MAX_QUARANTINED == 3
    kept = [c.read_bytes()[: len("damage number 2")] for c in copies]
    assert kept == [b"damage number 2", b"damage number 3", b"damage number 4"]


_PAGE = 4096  # NOTE: SQLite's default page size, which diskcache keeps


def _fill(folder: Path, now: list[float]) -> tuple[DiskStore, dict[str, bytes]]:
    """A closed store of 60 small entries (about six per page), two value files and one that
    expires at ``now[0] + 10`` (the store's clock), every row in ``cache.db`` (no WAL)."""
    store = DiskStore(folder, clock=lambda: now[0])
    values = {f"k{i:03d}": f"value-{i:04d}-".encode() * 50 for i in range(60)}
    values["big"] = b"B" * 100_000  # above diskcache's 32 kB: a value file
    for key, value in values.items():
        store.set(key, value)
    store.set("big-bad", b"C" * 100_000)
    store.set("expiring", b"x", ttl_s=10)
    store.close()
    with closing(sqlite3.connect(folder / "cache.db")) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (folder / "cache.db-wal").unlink(missing_ok=True)
    return store, values


def _damage_pages(db: Path, markers: list[bytes]) -> bytes:
    """Overwrite each page that holds one of ``markers``; return the pages' old bytes."""
    data = bytearray(db.read_bytes())
    old = b""
    for marker in markers:
        start = data.index(marker) // _PAGE * _PAGE
        old += bytes(data[start : start + _PAGE])
        data[start : start + _PAGE] = b"\xff" * _PAGE  # NOTE: not a valid b-tree page type
    db.write_bytes(bytes(data))
    return old


@pytest.mark.parametrize("damaged", [[30], [10, 40]], ids=["one page", "two pages"])
def test_a_damaged_database_gives_what_reads_back_whole_to_the_new_one(
    tmp_path: Path, damaged: list[int]
) -> None:
    # NOTE: issue 35: entries on intact pages were served until a read met a damaged page; the
    # whole database was then moved aside and every entry lost with it.
    folder = tmp_path / "c"
    now = [1000.0]
    store, values = _fill(folder, now)
    lost_pages = _damage_pages(folder / "cache.db", [f"value-{i:04d}-".encode() for i in damaged])
    (bad_file,) = (p for p in folder.rglob("*.val") if p.read_bytes()[-1:] == b"C")
    bad_file.write_bytes(bad_file.read_bytes()[:-1] + b"D")  # fails its checksum
    now[0] += 60  # "expiring" is past its TTL (store clock)
    assert store.get("k000") == values["k000"]  # the damage is not seen yet
    with pytest.warns(CacheRecoveryWarning, match="damaged") as record:
        for i in damaged:
            assert store.get(f"k{i:03d}") is None
    served = {key: store.get(key) for key in values}
    assert all(got == values[key] for key, got in served.items() if got is not None)
    # every entry whose row was not on a damaged page (its bytes are not there) is kept
    kept = {key for key, value in values.items() if value[:11] not in lost_pages}
    assert kept <= {key for key, got in served.items() if got is not None}
    assert {f"k{i:03d}" for i in range(55, 60)} | {"big"} <= kept  # rows past the damage too
    assert store.get("big-bad") is None and store.get("expiring") is None
    num_served = sum(got is not None for got in served.values())
    message = str(record[0].message)
    assert f"recreated it with the {num_served} entries that still read back whole" in message
    (copy,) = (p for p in folder.glob("cache.db.damaged-*") if p.name[-4:] not in ("-wal", "-shm"))
    assert str(copy) in message
    assert not bad_file.exists()  # the damaged database's value files are gone
    store.check_integrity()


def test_a_database_unreadable_at_open_gives_its_readable_entries_too(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    _, values = _fill(folder, [0.0])
    with closing(sqlite3.connect(folder / "cache.db")) as conn:
        sql = "SELECT rootpage FROM sqlite_master WHERE name = 'Settings'"
        ((settings_page,),) = conn.execute(sql).fetchall()
    data = bytearray((folder / "cache.db").read_bytes())
    at = (settings_page - 1) * _PAGE  # NOTE: SQLite numbers pages from 1
    data[at : at + _PAGE] = b"\xff" * _PAGE  # diskcache reads its settings when it opens
    (folder / "cache.db").write_bytes(bytes(data))
    with pytest.warns(CacheRecoveryWarning, match="unreadable") as record:
        store = DiskStore(folder)
    assert "recreated it with the 62 entries" in str(record[0].message)
    assert {key: store.get(key) for key in values} == values
    assert store.get("big-bad") == b"C" * 100_000
    assert store.get("expiring") is None  # its 10 s ran out at 10.0 on the old store's clock


def test_damaged_value_file_is_dropped_not_returned(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c")
    store.set("big", b"a" * 100_000)  # above diskcache's 32 kB threshold: lives in a .val file
    (value_file,) = (tmp_path / "c").rglob("*.val")
    data = bytearray(value_file.read_bytes())
    data[50_000] ^= 0xFF  # one flipped bit-pattern in the middle
    value_file.write_bytes(bytes(data))
    with pytest.raises(CacheIntegrityError, match="checksum"):
        store.check_integrity()
    with pytest.warns(CacheRecoveryWarning, match="checksum"):
        assert store.get("big") is None
    assert store.stats().entries == 0
    store.check_integrity()


def test_leftovers_of_a_killed_writer_pass_but_a_lost_value_file_does_not(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    store = DiskStore(folder)
    store.set("big", b"a" * 100_000)  # lives in a .val file
    (value_file,) = folder.rglob("*.val")
    # What SIGKILL inside diskcache's set() can leave (each kill point forced in a child process):
    # an empty value folder (killed after makedirs, or after deleting a replaced value file but
    # before removing its folder), a half-made one, and an orphan file with no committed row.
    free = [f"{i:02x}" for i in range(256) if f"{i:02x}" != value_file.parent.parent.name]
    (folder / free[0] / "ab").mkdir(parents=True)
    (folder / free[1]).mkdir()
    (folder / free[2] / "cd").mkdir(parents=True)
    (folder / free[2] / "cd" / "orphan.val").write_bytes(b"partial")
    store.check_integrity()
    assert store.get("big") == b"a" * 100_000
    value_file.unlink()  # a committed row whose file is gone is damage
    with pytest.raises(CacheIntegrityError, match="file not found"):
        store.check_integrity()


_ROUNDS = 4
"""Passes each hammering process makes over the 50 inputs."""


def _hammer(
    directory: str, worker: int, start: BarrierType, queue: mp.Queue[tuple[int, int, int]]
) -> None:
    store = DiskStore(directory)
    cache = ToolCache(store)
    runs = 0

    def square(n: int) -> dict[str, int]:
        nonlocal runs
        runs += 1
        return {"n": n, "square": n * n, "pad": worker * 0}

    tool = cache.wrap(square, name="square", version="1")
    # NOTE: a fixed number of calls, started together: a wall-clock budget made the count depend
    # on the machine's load (a starved process covered fewer than the 50 inputs).
    start.wait(timeout=120)
    calls = 0
    for calls in range(1, _ROUNDS * 50 + 1):
        n = calls % 50
        assert tool(n) == {"n": n, "square": n * n, "pad": 0}
        if calls % 97 == 0:
            store.set(f"raw-{worker}-{calls}", os.urandom(40_000))  # some value files too
    queue.put((worker, calls, runs))


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    queue: mp.Queue[tuple[int, int, int]] = ctx.Queue()
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), w, start, queue)) for w in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert [calls for _, calls, _ in results] == [_ROUNDS * 50] * 2
    # Each of the 50 inputs ran at least once, and at most once per process: a process always
    # finds what it stored itself (the other's equal write may replace it).
    runs = [num_runs for _, _, num_runs in results]
    assert all(num_runs <= 50 for num_runs in runs) and 50 <= sum(runs) <= 100
    store = DiskStore(tmp_path)
    store.check_integrity()
    tool = ToolCache(store).wrap(lambda n: None, name="square", version="1")
    assert tool(7) == {"n": 7, "square": 49, "pad": 0}


def _writer(directory: str, ready: str) -> None:
    store = DiskStore(directory)
    i = 0
    while True:
        store.set(f"k{i % 200}", bytes([i % 256]) * (1000 + 37 * (i % 1500)))
        if i == 50:
            Path(ready).touch()
        i += 1


def test_writer_killed_mid_write_leaves_cache_readable(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_writer, args=(str(tmp_path / "c"), str(ready)))
    proc.start()
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # let it write a while longer, then kill it without warning
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    store = DiskStore(tmp_path / "c")
    store.check_integrity()
    found = 0
    for k in range(200):
        value = store.get(f"k{k}")
        if value is not None:
            found += 1
            assert len(set(value)) == 1  # a whole value written by one set(), never a torn one
    assert found > 0
