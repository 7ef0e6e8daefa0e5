"""Checks and clean-up around the mountpoint itself (stale mounts, busy mountpoints)."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import subprocess

log = logging.getLogger(__name__)


FSTYPE = "fuse.shardfs"


class MountpointError(Exception):
    """The mountpoint cannot be used; the message says why and what to do."""


def _unescape(field: str) -> str:
    """Mount paths in /proc/self/mountinfo escape space, tab, newline and backslash in octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounted_fstype(path: str) -> str | None:
    """The filesystem type mounted exactly at `path` (the topmost one), or None."""
    path = os.path.realpath(path)
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                if _unescape(fields[4]) == path:
                    found = fields[sep + 1]  # later lines are mounted on top of earlier ones
    except OSError:
        return None
    return found


def shardfs_mounts() -> list[str]:
    """Every shardfs mountpoint this process can see, in mount order."""
    found: list[str] = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                if fields[sep + 1] == FSTYPE and _unescape(fields[4]) not in found:
                    found.append(_unescape(fields[4]))
    except OSError:
        pass
    return found

def listed_mount(path: str) -> bool:
    """Whether the absolute `path` is a mountpoint in this mount namespace, from the mount table
    alone: no stat, which would wait on a FUSE mount not yet served (realpath would)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return any(_unescape(line.split()[4]) == path for line in f)
    except OSError:
        return False


def shardfs_root(path: str) -> str | None:
    """The shardfs mountpoint that `path` lives under, or None."""
    path = os.path.realpath(path)
    while True:
        if mounted_fstype(path) == FSTYPE:
            return path
        if path == "/":
            return None
        path = os.path.dirname(path)


def is_stale(path: str) -> bool:
    """A FUSE mount whose daemon died: every access fails with ENOTCONN.

    statfs, unlike stat, is never answered from the kernel's attribute cache."""
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def unmount(path: str, *, lazy: bool = False) -> subprocess.CompletedProcess:
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is None:
        raise MountpointError("fusermount3 not found: install the fuse3 package")
    args = [tool, "-u"] + (["-z"] if lazy else []) + [path]
    return subprocess.run(args, capture_output=True, text=True, check=False)


def unmount_shardfs(path: str, *, lazy: bool = False) -> None:
    """`shardfs umount`: unmount a shardfs mount, and nothing else."""
    path = os.path.abspath(path)
    fstype = mounted_fstype(path)
    if fstype is None:
        if not os.path.exists(path):
            raise MountpointError(f"{path} does not exist")
        raise MountpointError(f"{path} is not mounted")
    if fstype != FSTYPE:
        raise MountpointError(f"{path} is not a shardfs mount (it is {fstype}); not touching it")
    result = unmount(path, lazy=lazy)
    if result.returncode != 0:
        reason = result.stderr.strip()
        if "busy" in reason.lower():
            raise MountpointError(f"{path} is busy (a process has a file open or its working "
                                  f"directory in it); stop it, or detach now and unmount "
                                  f"when it lets go: shardfs umount --lazy {path}")
        raise MountpointError(f"cannot unmount {path}: {reason}")


def prepare_mountpoint(path: str, *, nonempty: bool = False) -> str:
    """Absolute path of a usable mountpoint; cleans a stale mount left by a crashed daemon."""
    path = os.path.abspath(path)
    if is_stale(path):
        log.warning("cleaning stale mount at %s left by a daemon that died", path)
        result = unmount(path, lazy=True)
        if result.returncode != 0 or is_stale(path):
            raise MountpointError(f"{path} is a stale mount and could not be cleaned: "
                                  f"{result.stderr.strip()}")
    if not os.path.exists(path):
        raise MountpointError(f"mountpoint {path} does not exist (create it with mkdir -p)")
    if not os.path.isdir(path):
        raise MountpointError(f"mountpoint {path} is not a directory")
    if os.path.ismount(path):
        raise MountpointError(f"mountpoint {path} is busy: something is already mounted there "
                              f"(unmount it first: shardfs umount {path})")
    if not nonempty:
        try:
            entries = sorted(os.listdir(path))
        except OSError as exc:
            raise MountpointError(f"mountpoint {path} cannot be listed: {exc.strerror}") \
                from None
        if entries:
            raise MountpointError(
                f"mountpoint {path} is not empty ({len(entries)} entries, e.g. {entries[0]!r}); "
                "mounting would hide them: use an empty directory, or --nonempty "
                "(-o nonempty) to mount over them")
    return path


def is_mounted(path: str) -> bool:
    """Whether something is mounted at `path` in this process's mount namespace."""
    return mounted_fstype(path) is not None
