"""Which filesystem a folder lives on, from the Linux mount table: SQLite's locks need a local one.

SQLite relies on POSIX advisory locks, which network filesystems implement badly or not at all
(https://www.sqlite.org/howtocorrupt.html section 2.1; diskcache's docs warn about NFS). This
module only parses mount tables; it knows nothing about caches. Outside Linux (no
``/proc/self/mountinfo``) it answers "unknown" and nothing is flagged.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MOUNTINFO_PATH", "NETWORK_FS_TYPES", "filesystem_type", "network_filesystem"]

MOUNTINFO_PATH = "/proc/self/mountinfo"
"""The mount table read by ``network_filesystem`` (``/proc/mounts`` lines are understood too)."""

NETWORK_FS_TYPES = frozenset(
    {
        "9p",
        "afs",
        "beegfs",
        "ceph",
        "cifs",
        "davfs",
        "fuse.ceph",
        "fuse.gcsfuse",
        "fuse.glusterfs",
        "fuse.juicefs",
        "fuse.rclone",
        "fuse.s3fs",
        "fuse.sshfs",
        "glusterfs",
        "gpfs",
        "lustre",
        "ncpfs",
        "nfs",
        "nfs4",
        "orangefs",
        "smb3",
        "smbfs",
    }
)
"""Filesystem types (as the kernel names them in the mount table) shared over a network, where
file locking is unreliable for SQLite."""


def _unescape(field: str) -> str:
    """Mount tables write space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mounts(table: str) -> list[tuple[str, str]]:
    """(mount point, fs type) per line of a ``mountinfo`` or ``/proc/mounts`` table, in order."""
    found = []
    for line in table.splitlines():
        fields = line.split()
        if " - " in line and fields and fields[0].isdigit():  # mountinfo: "... - type source opts"
            head, _, tail = line.partition(" - ")
            head_fields, tail_fields = head.split(), tail.split()
            if len(head_fields) >= 5 and tail_fields:
                found.append((_unescape(head_fields[4]), tail_fields[0]))
        elif len(fields) >= 3:  # /proc/mounts: "source point type opts 0 0"
            found.append((_unescape(fields[1]), fields[2]))
    return found


def filesystem_type(path: str | os.PathLike[str], table: str) -> str | None:
    """The type of the filesystem holding ``path`` per the mount ``table`` text, or ``None``.

    The longest mount point that contains ``path`` (after resolving symlinks) wins; of several
    mounts on the same point, the last one, which hides the others.
    """
    parts = Path(path).resolve().parts
    best: tuple[int, str] | None = None
    for point, fs_type in _mounts(table):
        point_parts = Path(point).parts
        if parts[: len(point_parts)] == point_parts and (
            best is None or len(point_parts) >= best[0]
        ):
            best = (len(point_parts), fs_type)
    return None if best is None else best[1]


def network_filesystem(path: str | os.PathLike[str], table: str | None = None) -> str | None:
    """The network filesystem type holding ``path`` (``"nfs4"``...), else ``None``.

    Args:
        path: A folder (it need not exist yet; its nearest existing parent decides).
        table: Mount table text; default: read ``MOUNTINFO_PATH`` (``None`` when unreadable,
            e.g. not Linux).
    """
    if table is None:
        try:
            with open(MOUNTINFO_PATH, encoding="utf-8", errors="replace") as f:
                table = f.read()
        except OSError:
            return None
    fs_type = filesystem_type(path, table)
    return fs_type if fs_type in NETWORK_FS_TYPES else None
