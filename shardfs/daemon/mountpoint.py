"""Checks and clean-up around the mountpoint itself (stale mounts, busy mountpoints)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess

log = logging.getLogger(__name__)


class MountpointError(Exception):
    """The mountpoint cannot be used; the message says why and what to do."""


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


def prepare_mountpoint(path: str) -> str:
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
    return path


def is_mounted(path: str) -> bool:
    """Whether `path` is a mountpoint in this process's mount namespace."""
    target = os.path.abspath(path)
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == target for line in f)
    except OSError:
        return False
