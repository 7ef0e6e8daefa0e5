"""A FUSE mount made the way a CSI node plugin makes one: open /dev/fuse, mount(2) with fd=N,
and hand the descriptor to a server (`shardfs mount ... --fuse-fd N`). Needs root."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def can_mount() -> bool:
    return os.geteuid() == 0 and os.path.exists("/dev/fuse")


FUSECTL = Path("/sys/fs/fuse/connections")


def connection_of(mountpoint: Path) -> Path | None:
    """/sys/fs/fuse/connections/<minor of the mount's device> (from mountinfo; no stat of a
    mount that may hang)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(mountpoint):
                return FUSECTL / fields[2].split(":")[1]
    return None


def abort_connection(mountpoint: Path) -> bool:
    """Abort the mount's FUSE connection (every request waiting on it fails), mounting fusectl
    first where nobody has; what a test does when a daemon could not end. True if aborted."""
    conn = connection_of(mountpoint)
    if conn is None:
        return False
    mounted_here = not os.path.ismount(FUSECTL) and _libc.mount(
        b"fusectl", bytes(FUSECTL), b"fusectl", 0, None) == 0
    try:
        (conn / "abort").write_text("1")
    except OSError:
        return False
    finally:
        if mounted_here:
            _libc.umount2(bytes(FUSECTL), MNT_DETACH)
    return True


class FuseMount:
    """An open /dev/fuse descriptor mounted at `mountpoint`, not yet served (INIT pending)."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        options = (f"fd={self.fd},rootmode=40000,user_id={os.getuid()},"
                   f"group_id={os.getgid()},allow_other,default_permissions")
        if _libc.mount(b"shardfs", os.fsencode(mountpoint), b"fuse.shardfs",
                       MS_RDONLY | MS_NOSUID | MS_NODEV, options.encode()) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"mount {mountpoint}: {os.strerror(err)}")

    def connection(self) -> Path | None:
        return connection_of(self.mountpoint)

    def mounted(self) -> bool:
        return self.connection() is not None

    def close(self) -> None:
        """Abort the connection (nothing may hang on it), detach the mount, close the fd."""
        if self.mounted():
            abort_connection(self.mountpoint)
            _libc.umount2(os.fsencode(self.mountpoint), MNT_DETACH)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
