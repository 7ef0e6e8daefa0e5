"""`shardfs doctor`'s checks of this machine: FUSE, our shim, the cache dir, memory.

Each check returns a Check: what was found, and a fix when something is wrong. `fail` blocks
mounting, `slow` makes reads slower than they could be, `note` is worth knowing and changes
nothing on its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardfs.util.fstypes import ShardStorage
from shardfs.util.sizes import format_size

FUSE_MAJOR, FUSE_MINOR = 10, 229
DISK_SAMPLE = 16 << 20  # bytes written (and fdatasync'ed) to time the cache disk
SLOW_DISK_BPS = 100 << 20  # below this the cache disk is slower than a 1 Gb/s link


@dataclass(slots=True)
class Check:
    name: str
    verdict: str  # ok | note | slow | fail
    detail: str
    fix: str = ""
    value: float | None = None  # the number measured, where one is (bytes/s)

    @property
    def problem(self) -> bool:
        return self.verdict in ("slow", "fail")


def _kernel() -> tuple[int, int]:
    release = os.uname().release
    parts = [*release.split("-")[0].split("."), "0", "0"][:2]
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except ValueError:
        return 0, 0


def check_dev_fuse(path: str = "/dev/fuse") -> Check:
    name = "/dev/fuse"
    try:
        st = os.stat(path)
    except OSError as exc:
        return Check(name, "fail", f"{path}: {exc.strerror}",
                     "load the module (modprobe fuse); in a container, pass the device "
                     "(docker run --device /dev/fuse --cap-add SYS_ADMIN) or use the CSI driver")
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != \
            (FUSE_MAJOR, FUSE_MINOR):
        return Check(name, "fail", f"{path} is not the FUSE device (char 10:229)",
                     "the container or host replaced /dev/fuse: pass the real device")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return Check(name, "fail", f"cannot open {path}: {exc.strerror} (as uid {os.getuid()})",
                     "give this user access (chmod 0666 /dev/fuse is the usual mode, or add "
                     "the user to its group); in a container: --device /dev/fuse and a "
                     "device cgroup rule that allows it")
    os.close(fd)
    return Check(name, "ok", f"{path} opens for reading and writing")


def check_fusermount(allow_other: bool) -> Check:
    name = "fusermount3"
    path = shutil.which("fusermount3")
    root = os.geteuid() == 0
    if path is None:
        return Check(name, "note" if root else "fail",
                     "fusermount3 is not on PATH" + (" (root mounts without it, but "
                                                     "`shardfs umount` uses it)" if root else ""),
                     "install fuse3 (apt install fuse3, dnf install fuse3)")
    st = os.stat(path)
    if not root and not (st.st_mode & stat.S_ISUID and st.st_uid == 0):
        return Check(name, "fail", f"{path} is not setuid root: users cannot mount",
                     f"chmod u+s {path} (as packaged by fuse3)")
    if allow_other and not root:
        try:
            conf = Path("/etc/fuse.conf").read_text()
        except OSError:
            conf = ""
        if not any(line.strip() == "user_allow_other" for line in conf.splitlines()):
            return Check("allow_other", "fail", "--allow-other asked for, but /etc/fuse.conf "
                         "has no `user_allow_other` line: the mount would be refused",
                         "add the line `user_allow_other` to /etc/fuse.conf (as root)")
    return Check(name, "ok", path + (" (user_allow_other set)" if allow_other and not root
                                     else ""))


def check_kernel() -> Check:
    """The kernel features shardfs uses, from its version (the FUSE ones cannot be probed
    without mounting)."""
    major, minor = _kernel()
    version = (major, minor)
    missing = []
    if version < (6, 9):
        missing.append("FUSE_NOTIFY_RESEND (6.9): a killed FUSE worker can cost a read one "
                       "EIO")
    if version < (5, 3):
        missing.append("pidfd_open (5.3): workers' deaths are noticed later")
    if version < (4, 20):
        missing.append("FUSE cache_readdir (4.20): listings are not cached by the kernel")
    release = os.uname().release
    if missing:
        return Check("kernel", "note", f"Linux {release} lacks " + "; ".join(missing),
                     "a newer kernel (6.9 or later) has them")
    return Check("kernel", "ok", f"Linux {release}: FUSE_NOTIFY_RESEND, pidfd, cache_readdir")


def check_shim() -> Check:
    """Our pyfuse3 shim built and loadable: it saves the OPEN, answers metadata and cached
    reads in C and makes `--workers` possible (docs/pyfuse3.md)."""
    from shardfs.fuse import shim

    if shim.load_error:
        return Check("pyfuse3 shim", "slow", f"not loaded: {shim.load_error}; every file read "
                     "costs an OPEN, metadata is answered in Python, one process serves all",
                     "unset SHARDFS_NO_SHIM; or rebuild it (pip install --force-reinstall "
                     "shardfs, needs a C compiler and libfuse3-dev)")
    return Check("pyfuse3 shim", "ok", "built and loaded")


def check_body_splice() -> Check:
    """Plain-HTTP downloads spliced into the cache by a thread of C (`_bodysplice`), off the
    daemon's loop thread, its serial part (docs/sources.md, "Bodies spliced by a thread of
    C")."""
    from shardfs.sources import h1

    if h1._bodysplice is None:
        return Check("download thread", "slow", "shardfs/sources/_bodysplice.c is not built: "
                     "the daemon's loop thread splices every http:// download itself "
                     "(~9 us more of its CPU per cold ~24 KiB file, docs/sources.md)",
                     "rebuild shardfs (pip install --force-reinstall shardfs, needs a C "
                     "compiler)")
    if not h1.BODIES_BY_THREAD:
        return Check("download thread", "note", "SHARDFS_BODIES_BY_THREAD=0: the daemon's "
                     "loop thread splices every http:// download itself",
                     "unset SHARDFS_BODIES_BY_THREAD")
    return Check("download thread", "ok", "http:// downloads are spliced into the cache by "
                 "a thread of C")


def check_crc32c() -> Check:
    """CRC-32C with the CPU's instructions: it checks each complete download at a tenth of
    sha256's CPU (docs/design.md, "What a download is checked against")."""
    from shardfs.util import checksum

    if not checksum.FAST_CRC32C:
        return Check("download check", "slow", "no CRC-32C instructions (SSE 4.2 / ARMv8 CRC) "
                     "in use: downloads are checked by their index's sha256 where it has one "
                     "(~0.6 ms of CPU per MiB), else by CRC-32C in software",
                     "unset CRC32C_SW_MODE if it is set to force (the crc32c package uses "
                     "the instructions where the CPU has them)")
    return Check("download check", "ok", "CRC-32C with the CPU's instructions (crc32c): "
                 "~0.07 ms of CPU per MiB downloaded")


def check_mount_shim(snapshot: dict) -> Check:
    mountpoint = snapshot.get("mountpoint", "?")
    if snapshot.get("shim") is False:
        return Check("mount's shim", "slow", f"the mount at {mountpoint} runs without the pyfuse3 "
                     "shim (an OPEN per file, metadata in Python, no worker processes)",
                     "remount without SHARDFS_NO_SHIM in the daemon's environment, with the "
                     "shim built (see the check above)")
    if "shim" not in snapshot:
        return Check("mount's shim", "note", f"the daemon of {mountpoint} does not say "
                     "(an older shardfs)")
    return Check("mount's shim", "ok", f"in effect at {mountpoint}, "
                 f"{snapshot.get('worker_count', 0)} worker processes")


def shard_storage(cache_dir: Path) -> ShardStorage:
    """auto's judgement of shard files beside this cache dir (which may not exist yet)."""
    return ShardStorage(str(nearest_existing(cache_dir)))


def in_place_judge(in_place: str, storage: ShardStorage) -> Callable[[str], bool]:
    """Whether a mount with `in_place` (auto, on, off) reads the plain local shard at a path
    in place, as read/inplace.py decides (which also checks it against its index)."""
    if in_place in ("on", "off"):
        return lambda path: in_place == "on"

    def reads_in_place(path: str) -> bool:
        try:
            return storage.copied_because(os.stat(path).st_dev) is None
        except OSError:
            return False

    return reads_in_place


def check_local_shards(paths: list[str], in_place: str,
                       storage: ShardStorage) -> Check | None:
    """Shards named by file:// URLs or paths: read in place, or copied (and should they?).
    `in_place`: the mount's setting, auto (the default), on or off."""
    if not paths:
        return None
    devices = []
    for path in paths:
        with contextlib.suppress(OSError):  # the source checks say what cannot be read
            devices.append(os.stat(path).st_dev)
    types = sorted({storage.types.get(dev) or "?" for dev in devices}) or ["?"]
    on = f"{len(paths)} shard files on {', '.join(types)}"
    reasons = Counter(storage.copied_because(dev) for dev in devices)
    read_in_place = reasons.pop(None, 0)
    whys = "; ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
    if in_place == "auto":
        if not reasons:
            return Check("shard files", "ok", f"{on}, on a local disk: read in place "
                         "(--in-place auto)")
        if not read_in_place:
            return Check("shard files", "ok", f"{on}, copied into the cache (--in-place auto: "
                         f"{whys})")
        return Check("shard files", "ok", f"{on}: {read_in_place} read in place, the others "
                     f"copied into the cache (--in-place auto: {whys})")
    if in_place == "on":
        return Check("shard files", "ok", f"{on}, read in place")
    if read_in_place:  # off: copies what auto would read in place
        local = "(a local disk)" if not reasons else \
            f"({read_in_place} of them on a local disk)"
        return Check("shard files", "note", f"{on} {local}, copied into the cache: a "
                     "second copy on disk, and ~2.5x the daemon's CPU per cold file",
                     "mount without --in-place off (auto, the default, reads the shards "
                     "on a local disk from their own files; docs/sources.md, \"`file://` and "
                     "plain paths\")")
    return Check("shard files", "ok", f"{on}, copied into the cache (as auto would: {whys})")


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_cache_dir(cache_dir: Path, cache_size: int | None) -> list[Check]:
    where = nearest_existing(cache_dir)
    checks = []
    if not os.access(where, os.W_OK | os.X_OK):
        return [Check("cache dir", "fail", f"{where} is not writable by uid {os.getuid()}",
                      "choose another --cache-dir, or fix its permissions")]
    usage = shutil.disk_usage(where)
    held = sum(f.lstat().st_size for f in (cache_dir / "shards").glob("*")) \
        if (cache_dir / "shards").is_dir() else 0
    room = usage.free + held
    if cache_size is not None and room < cache_size:
        checks.append(Check("cache space", "slow", f"{cache_dir}: {format_size(usage.free)} "
                            f"free (+{format_size(held)} cached), less than the cache size "
                            f"{format_size(cache_size)}: the budget will shrink to what fits",
                            "free space there, or a smaller --cache-size"))
    else:
        checks.append(Check("cache space", "ok", f"{format_size(usage.free)} free at {where}"))
    checks.append(_disk_speed(where))
    return checks


def _disk_speed(where: Path) -> Check:
    """Write DISK_SAMPLE bytes and fdatasync them: how fast shards can land in the cache."""
    block = os.urandom(1 << 20)
    try:
        fd, name = tempfile.mkstemp(prefix=".shardfs-doctor-", dir=where)
    except OSError as exc:
        return Check("cache disk", "fail", f"cannot create a file in {where}: {exc.strerror}",
                     "choose another --cache-dir")
    try:
        start = time.monotonic()
        written = 0
        while written < DISK_SAMPLE:
            written += os.write(fd, block)
        os.fdatasync(fd)
        seconds = time.monotonic() - start
    except OSError as exc:
        return Check("cache disk", "fail", f"writing to {where}: {exc.strerror}",
                     "free space there, or choose another --cache-dir")
    finally:
        os.close(fd)
        os.unlink(name)
    bps = written / max(seconds, 1e-6)
    detail = f"{format_size(int(bps))}/s written and synced ({format_size(written)})"
    if bps < SLOW_DISK_BPS:  # slow only if slower than the store, when that is measured
        return Check("cache disk", "note", detail + ": slower than a 1 Gb/s link",
                     "a local SSD or tmpfs for --cache-dir", value=bps)
    return Check("cache disk", "ok", detail, value=bps)


def disk_against_store(disk: Check, store_bps: float) -> None:
    """Say so when the store sends faster than the cache disk syncs. A note, not a problem:
    fetched bytes land in the page cache first and are synced once per shard, so the disk
    limits only what outlasts the kernel's dirty-page room (a one-off sample cannot tell)."""
    if disk.value is not None and disk.value < store_bps:
        disk.verdict = "note"
        disk.detail += f"; the store sent {format_size(int(store_bps))}/s on one connection"
        disk.fix = disk.fix or "a faster disk (local SSD, tmpfs) for --cache-dir if fetches lag"


def check_memory(dataset_bytes: int | None) -> Check:
    """Room in the page cache: pushing arrived shards' files there needs the dataset (its
    shards fetched into the cache: those read in place are not pushed) to fit a quarter of the
    memory this process may use (the machine's or its cgroup's limit)."""
    from shardfs.fuse.pagepush import _cgroup_limits, memory_available_to_us

    memory = memory_available_to_us()
    if memory is None:
        return Check("memory", "note", "cannot tell this machine's memory")
    limits = [limit for limit in _cgroup_limits() if limit <= memory]
    where = f"cgroup limit {format_size(min(limits))}" if limits else "no lower cgroup limit"
    detail = f"{format_size(memory)} usable ({where})"
    if dataset_bytes is not None and dataset_bytes > memory // 4:
        return Check("memory", "note", detail + f"; the dataset ({format_size(dataset_bytes)}) "
                     "is more than a quarter of it: arrived shards are not pushed into the page "
                     "cache, first reads of a file go to the daemon",
                     "more memory (or a higher cgroup limit) for the mount's page cache")
    return Check("memory", "ok", detail)
