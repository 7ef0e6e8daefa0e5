"""Which kind of storage a file lies on: a local disk (spinning or not), or something served
from afar.

File system types are read from /proc/self/mountinfo, whose third field is the device number
(`st_dev`) that files of each mount report: one parse serves any number of files (`stat` each,
look its device up). Whether a disk spins is the kernel's `queue/rotational` in sysfs; whether
it is a cloud's network-backed volume (which reports itself as not spinning: EBS on Nitro is
an NVMe device), its `device/model`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


# File systems whose files keep every page in memory: a read of them never waits for a disk
# (only for swap), and they do not take RWF_NOWAIT (tmpfs answers EOPNOTSUPP). Reads of cached
# bytes on them are plain preads (read/diskread.py, the shim's C reads).
MEMORY_FILESYSTEMS = frozenset(("tmpfs", "ramfs"))
_memory_devices: dict[int, bool] = {}


def memory_backed(fd: int) -> bool:
    """Whether `fd`'s file lies on a file system held in memory (MEMORY_FILESYSTEMS). One
    `fstat`; the mount table is read once per device number seen (a device number reused by
    a later mount keeps the first answer: at worst a plain read that waits for a disk)."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return False
    known = _memory_devices.get(dev)
    if known is None:
        known = _memory_devices[dev] = device_types().get(dev) in MEMORY_FILESYSTEMS
    return known


# Models of block devices that are volumes served over the cloud's network, by the start of
# their `device/model`: AWS EBS (NVMe on Nitro), Google Persistent Disk (SCSI, and NVMe as
# `nvme_card-pd`; local SSDs are `nvme_card`), Azure's remote disks on NVMe. Reading their
# data again costs the volume's provisioned throughput, as a spinning disk's costs seeks.
NETWORK_VOLUME_MODELS = ("Amazon Elastic Block Store", "PersistentDisk", "nvme_card-pd",
                         "MSFT NVMe Accelerator")


@dataclass(frozen=True)
class Disk:
    """The block device behind a file system: its kernel name (sda, nvme0n1p2, dm-0),
    whether the kernel takes it for a spinning one, and the model of a network-backed volume
    (NETWORK_VOLUME_MODELS; None for any other disk)."""

    name: str
    rotational: bool
    network_model: str | None = None

    @property
    def slow(self) -> bool:
        """Slower to read again than a local disk that does not spin."""
        return self.rotational or self.network_model is not None


def disk_of(dev: int, sys_root: str = "/sys") -> Disk | None:
    """The block device whose file system reports `st_dev` `dev`, or None where none backs it
    (tmpfs, NFS, FUSE, btrfs's and zfs's own device numbers) or sysfs cannot tell. A
    partition's answer is its disk's (only a whole disk has a queue)."""
    node = f"{sys_root}/dev/block/{os.major(dev)}:{os.minor(dev)}"
    # The kernel resolves the link before "..": a partition's ".." is its disk.
    disk = f"{node}/.." if os.path.exists(f"{node}/partition") else node
    try:
        with open(f"{disk}/queue/rotational") as f:
            spins = f.read().strip() == "1"
    except OSError:
        return None
    try:  # an NVMe namespace's `device` is its controller, which has the model
        with open(f"{disk}/device/model") as f:
            model = f.read().strip()
    except OSError:
        model = ""
    network = model if model.startswith(NETWORK_VOLUME_MODELS) else None
    return Disk(os.path.basename(os.path.realpath(node)), spins, network)


class ShardStorage:
    """`in_place auto`'s judgement of a shard file's storage: read in place, or copied.

    Copied: a shard on a file system served from afar (not in LOCAL_FILESYSTEMS), where the
    copy turns reads into one sequential read per shard; and a shard on a spinning disk or a
    cloud's network-backed volume while the cache dir lies on a local disk that does not spin
    (an HDD array beside an NVMe drive, an EBS volume beside the instance's NVMe store: the
    copy moves each shard once, sequentially, to the faster disk, and its members' reads go
    there). A disk the kernel cannot tell about (tmpfs, btrfs, zfs) counts as a fast one."""

    def __init__(self, cache_dir: str, sys_root: str = "/sys") -> None:
        self.types = device_types()
        self._sys_root = sys_root
        self._disks: dict[int, Disk | None] = {}
        try:
            self.cache_disk = self.disk(os.stat(cache_dir).st_dev)
        except OSError:
            self.cache_disk = None

    def disk(self, dev: int) -> Disk | None:
        if dev not in self._disks:
            self._disks[dev] = disk_of(dev, self._sys_root)
        return self._disks[dev]

    def copied_because(self, dev: int) -> str | None:
        """Why a file on `st_dev` `dev` is copied, as "on ..." words for a log line; None:
        read in place."""
        kind = self.types.get(dev)
        if kind not in LOCAL_FILESYSTEMS:
            return f"on {kind or 'an unknown file system'} (not a local disk)"
        cache = self.cache_disk
        if cache is not None and not cache.slow:
            shard = self.disk(dev)
            if shard is not None and shard.rotational:
                return (f"on a rotational disk ({shard.name}; the cache dir on "
                        f"{cache.name}, not rotational)")
            if shard is not None and shard.network_model is not None:
                return (f"on a network-backed volume ({shard.name}: {shard.network_model}; "
                        f"the cache dir on {cache.name}, a local disk)")
        return None
