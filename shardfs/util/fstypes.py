"""Which kind of file system a file lies on: a local disk, or something served from afar.

Read from /proc/self/mountinfo, whose third field is the device number (`st_dev`) that files
of each mount report: one parse serves any number of files (`stat` each, look its device up).
"""

from __future__ import annotations

import os

# File systems on the machine's own disks (or in memory): a shard there is served as well from
# its own file as from a copy of it (`--in-place`). Anything else (nfs, lustre, gpfs, ceph,
# cifs, fuse.*) is taken for one served over a network, where a copy on local disk is what
# turns reads into one sequential read per shard. squashfs and erofs are left out on purpose:
# their images are often files on a shared file system behind a loop device (Apptainer).
LOCAL_FILESYSTEMS = frozenset(("ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs",
                               "bcachefs", "jfs", "tmpfs", "ramfs", "overlay", "vfat", "exfat",
                               "ntfs3"))


def device_types() -> dict[int, str]:
    """st_dev -> file system type of every mount this process sees (the later mount wins)."""
    types: dict[int, str] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                major, _, minor = fields[2].partition(":")
                types[os.makedev(int(major), int(minor))] = fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        pass
    return types


def fstype_of(path: str, types: dict[int, str] | None = None) -> str | None:
    """The type of the file system `path` lies on, or None if it cannot be told."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    return (device_types() if types is None else types).get(dev)
