"""The node plugin's kernel calls: open /dev/fuse, mount(2) it with fd=N, read-only binds,
unmounts, and what /proc/self/mountinfo says is mounted where."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
import time
from dataclasses import dataclass

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_BIND = 4096
MNT_DETACH = 2

FSTYPE = "fuse.shardfs"

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _check(result: int, what: str, path: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what} {path}: {os.strerror(code)}", path)


def _enc(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None) -> None:
    enc = _enc
    _check(_libc.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)),
           "mount", target)


def mount_fuse(path: str, *, allow_other: bool = True) -> int:
    """Open /dev/fuse and mount a fresh, read-only FUSE connection on `path`; the descriptor
    is returned (the daemon that gets it answers INIT). Needs CAP_SYS_ADMIN."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    st = os.stat(path)
    options = [f"fd={fd}", f"rootmode={st.st_mode & 0o170000:o}", f"user_id={os.getuid()}",
               f"group_id={os.getgid()}", "default_permissions"]
    if allow_other:
        options.append("allow_other")
    try:
        _mount("shardfs", path, FSTYPE, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOATIME,
               ",".join(options))
    except OSError:
        os.close(fd)
        raise
    return fd


def bind_read_only(source: str, target: str) -> None:
    """`target` shows `source`, read-only (a bind is made, then remounted read-only, which
    is how the kernel takes MS_RDONLY for binds)."""
    _mount(source, target, None, MS_BIND, None)
    try:
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
               None)
    except OSError:
        unmount(target)
        raise


def unmount(path: str) -> None:
    """Unmount; a busy mount is detached (the last user's close ends it). Not mounted: no-op."""
    if _libc.umount2(path.encode(), 0) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
        return
    if code == errno.EBUSY:
        _check(_libc.umount2(path.encode(), MNT_DETACH), "unmount", path)
        return
    raise OSError(code, f"unmount {path}: {os.strerror(code)}", path)


@dataclass(frozen=True, slots=True)
class MountEntry:
    mount_id: int
    major_minor: str  # the superblock's device: binds of one FUSE mount share it
    root: str
    mountpoint: str
    fstype: str


def _unescape(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1:i + 4].isdigit() and len(text[i + 1:i + 4]) == 3:
            out.append(chr(int(text[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def mounts() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            entries.append(MountEntry(int(fields[0]), fields[2], _unescape(fields[3]),
                                      _unescape(fields[4]), right.split()[0]))
    return entries


def mount_at(path: str) -> MountEntry | None:
    """The top mount at `path` (the last one listed), if any."""
    found = None
    for entry in mounts():
        if entry.mountpoint == path:
            found = entry
    return found


def answers(paths: list[str], timeout: float = 5.0) -> dict[str, bool | None]:
    """For each FUSE mount: True if it answers statvfs, False if that fails (a dead
    connection gives ENOTCONN), None if no answer comes within `timeout` (the connection
    lives, nobody serves it right now; the asking thread is left to finish when an answer
    comes). All are asked at once."""
    results: dict[str, bool] = {}

    def ask(path: str) -> None:
        try:
            os.statvfs(path)
            results[path] = True
        except OSError:
            results[path] = False

    threads = [threading.Thread(target=ask, args=(p,), daemon=True, name="statvfs")
               for p in paths]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {p: results.get(p) for p in paths}
