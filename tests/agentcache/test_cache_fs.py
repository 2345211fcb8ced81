"""Network-filesystem detection from a mount table, and DiskStore's warning on one."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from agentcache.cache import DiskStore, NetworkFilesystemWarning, _fs

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /mnt/nfs rw,relatime shared:20 - nfs4 srv:/export rw,vers=4.2
41 40 8:2 / /mnt/nfs/local rw,relatime shared:21 - ext4 /dev/sdb1 rw
42 22 0:46 / /mnt/my\\040share rw shared:22 - cifs //srv/share rw
43 22 0:47 / /home/me/remote rw,nosuid shared:23 - fuse.sshfs me@srv:/ rw
44 22 0:48 / /srv/data rw - nfs srv:/data rw
45 44 8:3 / /srv/data rw - xfs /dev/sdc1 rw
"""
PROC_MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
srv:/export /mnt/nfs nfs4 rw,vers=4.2 0 0
"""


@pytest.mark.parametrize(
    ("path", "fs_type", "is_network"),
    [
        ("/mnt/nfs/cache", "nfs4", True),
        ("/mnt/nfs", "nfs4", True),
        ("/mnt/nfs/local/cache", "ext4", False),  # a local disk mounted inside the share
        ("/mnt/nfsish/cache", "ext4", False),  # a prefix of the name is not a parent folder
        ("/mnt/my share/cache", "cifs", True),  # octal escapes in mount points
        ("/home/me/remote/x", "fuse.sshfs", True),
        ("/srv/data/cache", "xfs", False),  # the later mount on a point hides the earlier
        ("/var/cache", "ext4", False),
    ],
)
def test_the_longest_mount_point_decides(path: str, fs_type: str, is_network: bool) -> None:
    assert _fs.filesystem_type(path, MOUNTINFO) == fs_type
    assert (_fs.network_filesystem(path, MOUNTINFO) is not None) == is_network


def test_proc_mounts_lines_are_understood_too() -> None:
    assert _fs.network_filesystem("/mnt/nfs/c", PROC_MOUNTS) == "nfs4"
    assert _fs.network_filesystem("/tmp/c", PROC_MOUNTS) is None
    assert _fs.filesystem_type("/tmp", "") is None


@pytest.fixture
def nfs_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A mount table on which ``tmp_path/share`` is an NFS mount."""
    share = tmp_path.resolve() / "share"
    table = tmp_path / "mountinfo"
    table.write_text(
        f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:45 / {share} rw - nfs4 s:/e rw\n"
    )
    monkeypatch.setattr(_fs, "MOUNTINFO_PATH", str(table))
    return share


def test_disk_store_on_nfs_warns_once_per_folder(nfs_at: Path) -> None:
    with pytest.warns(NetworkFilesystemWarning, match=r"network filesystem \(nfs4\)") as record:
        DiskStore(nfs_at / "a").close()
    assert "allow_network_fs=True" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiskStore(nfs_at / "a").close()  # the same folder again: no second warning
        DiskStore(nfs_at / "b", allow_network_fs=True).close()  # the explicit opt-out
        DiskStore(nfs_at.parent / "local").close()  # not on the share
    with pytest.warns(NetworkFilesystemWarning):
        DiskStore(nfs_at / "c").close()  # another folder on the share
