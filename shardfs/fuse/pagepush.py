"""Fetched shards' files pushed into the kernel's page cache (FUSE_NOTIFY_STORE).

Why: in a cold shuffled epoch almost every file is read after its shard has arrived — the
DataLoader's 4 workers each wait on one file at a time, so little is read while bytes are
still coming (docs/benchmarks-notes.md, "Arrived shards pushed into the page cache": 9-12 % of the
files by the link time at bench scale 3). Each such read was a FUSE READ the daemon answers
(2,400-3,500 files/s there), while pages already in the page cache are answered by the kernel
alone (~6,000 files/s). So, as each shard completes, its files' bytes go into the page cache
of their inodes, while the readers still wait on the link.

When (`worth_pushing`): only without OPEN requests (the shim in effect: pages then survive
every open of the file), and only when the dataset fits both the cache budget and a quarter of
the memory (the machine's, or its cgroup's limit if lower: the pages are charged to it); "the
dataset" here is its shards that are fetched into the cache (shards read in place are never
pushed and take no room in the cache).
Pushed pages are the pages a full pass over the files leaves in the page cache anyway
(docs/pyfuse3.md, "Members cached twice?"), only earlier; they are clean and reclaimable.

How: one shard at a time, in the order they complete, in a worker thread: `notify_store`
waits while the kernel holds a page locked for a READ that this process may be the one to
answer. Only files nobody has read yet are pushed: every READ that reaches the mount, in any
of its processes, marks its file (the shim's marks), and a READ's pages are in the page cache
already (pushing those cost 5-12 % in `bench node` with 2 workers, where the readers keep up
with the fetches). A file is pushed into its kernel inode. While pushing, listings give
every listed file one (READDIRPLUS entries with attributes; `shim.set_listing_inodes`,
docs/tuning.md "Listings that give inodes"): a loader that lists its directories first
(ImageFolder) costs no LOOKUP per file, the pusher's or its readers'. Whether the kernel has
the inode: the C loop's store of the file fails with ENOENT, storing nothing, where it has
not; the Python loop asks first with a zero-length `notify_store`. For a file without one,
where listings give inodes, its directory is listed by the lookup process, once (the inodes
of all its files for one request per ~300 of them); where they do not, or the listing gave
none (a directory listed before pushing began: the kernel's cached listing), the file is
looked up (a `stat` through the mount, answered in C like any LOOKUP) and pushed: the LOOKUP
the reader's `open` would have sent anyway, made earlier and off the reader's path (its
`open` then finds the cached entry).

Who looks files up: the lookup process (lookups.py, lookupproc.py), started at the first
push, never a thread of this process: this process may be the one that answers the LOOKUP
(the daemon serving alone), and a process SIGKILLed while a request to itself is read and
unanswered can never exit (its thread waits without interruption), so its mount would hang.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from array import array
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import pyfuse3  # after the shim: shardfs.fuse's __init__ loads it first
import trio

from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.tree import Tree
from shardfs.fuse import shim
from shardfs.fuse.lookups import GONE, LookupProcess, look_up

log = logging.getLogger(__name__)

PIECE = 4 << 20  # larger files are pushed in pieces of this size (bounded memory)


def worth_pushing(no_open: bool, fetched_bytes: int, cache_budget: int) -> bool:
    """Push completed shards into the page cache? See the module's docstring. `fetched_bytes`:
    the dataset's shards that come into the cache (those read in place never do)."""
    if not no_open or fetched_bytes > cache_budget:
        return False
    memory = memory_available_to_us()
    return memory is not None and fetched_bytes <= memory // 4


def memory_available_to_us() -> int | None:
    """Physical memory, or this process's cgroup memory limit if lower (a container's, a
    systemd unit's MemoryMax): pushed pages are charged to that cgroup."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    for limit in _cgroup_limits():
        memory = min(memory, limit)
    return memory


def _cgroup_limits() -> list[int]:
    """Memory limits of this process's cgroups and their ancestors (v2 memory.max, v1
    memory.limit_in_bytes): a limit on a parent (a systemd slice's MemoryMax=, a pod's)
    holds for every group below it."""
    limits = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return limits
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        group = root / path.lstrip("/")
        for directory in (group, *group.parents):
            try:
                text = (directory / name).read_text().strip()
            except OSError:
                text = ""  # the root group has no limit file
            if text.isdigit():  # "max": no limit
                limits.append(int(text))
            if directory == root:
                break
    return limits


@dataclass(slots=True)
class PushStats:
    shards: int = 0  # arrived shards gone through (their files not opened yet pushed)
    looked_up: int = 0  # files the pusher looked up (the kernel had no inode for them)
    files: int = 0
    bytes: int = 0
    listed: int = 0  # of files: pushed without a lookup (a listing gave the kernel its inode)
    dirs_listed: int = 0  # directories the lookup process listed (for their files' inodes)
    opened: int = 0  # not pushed: read already (a READ came; without the shim's marks: the
    #                  kernel had their inode)
    unknown: int = 0  # not pushed: still no inode after the pusher's own lookup
    errors: int = 0
    in_c: bool = False  # pushed by the shim's loop (not the Python one)


class PagePusher:
    def __init__(self, tree: Tree, cache: ShardCache, keys: list[str], mountpoint: str) -> None:
        self._tree = tree
        # Tree.files_by_shard, built by the first push (in its thread, not on the loop)
        self._index: tuple[array, array] | None = None
        self._cache = cache
        self._keys = keys
        self._mountpoint = os.fsencode(mountpoint)
        self._queue: deque[int] = deque()
        self._wake = trio.Event()
        self._off = False  # the kernel does not support it: stop
        # The loop in C (the shim's), unless the shim does not answer metadata (its arrays
        # are the tree's) or SHARDFS_PUSH_IN_PYTHON is set (to measure one against the other).
        self.in_c = (shim.can_push() and tree.parent.typecode == "I"
                     and not os.environ.get("SHARDFS_PUSH_IN_PYTHON"))
        self.stats = PushStats(in_c=self.in_c)
        self._lookups = LookupProcess()
        self._dirs_asked: set[int] = set()  # listed by the lookup process (_list_parent)

    def shard_complete(self, shard: int) -> None:
        """Reader.on_complete: queue a shard that has just arrived whole."""
        if not self._off:
            self._queue.append(shard)
            self._wake.set()

    def snapshot(self) -> dict[str, int]:
        return asdict(self.stats)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        try:
            shim.set_listing_inodes(True)  # before the mount is ready: for its first listings
            task_status.started()
            await self._push_as_they_come()
        finally:
            shim.set_listing_inodes(False)
            self._lookups.close()

    async def _push_as_they_come(self) -> None:
        while not self._off:
            if not self._queue:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            shard = self._queue.popleft()
            cached = self._cache.get(self._keys[shard])
            if cached is None or cached.fd is None:
                continue  # evicted already
            # Our own descriptor: the cache may evict the shard (and close its fd) meanwhile,
            # and a thread abandoned at shutdown must not read a reused fd number.
            fd = os.dup(cached.fd)
            counts = shim.PushCounts() if self.in_c else None
            try:
                await trio.to_thread.run_sync(self._push, fd, shard, counts,
                                             abandon_on_cancel=True, thread_name="shardfs push")
            finally:
                if counts is not None:
                    counts.stop = 1  # an abandoned C loop ends after its current file
            self.stats.shards += 1

    def _push(self, fd: int, shard: int, counts: shim.PushCounts | None) -> None:
        """In a worker thread: the shard's files nobody has opened yet, from its cache file to
        the kernel."""
        try:
            if self._index is None:
                self._index = self._tree.files_by_shard(len(self._keys))
            try:
                lookups = self._lookups.connect()
            except OSError as exc:  # could not start (stopped: the pusher is ending)
                if exc.errno != errno.EPIPE:
                    self.stats.errors += 1
                    log.warning("page push is off: no lookup process (%s)", exc)
                self._off = True
                return
            with lookups:
                if counts is not None:
                    self._push_in_c(fd, lookups, shard, counts)
                else:
                    self._push_in_python(fd, lookups, shard)
        finally:
            os.close(fd)

    def _push_in_c(self, fd: int, lookups: socket.socket, shard: int,
                   counts: shim.PushCounts) -> None:
        """The shim's loop (shardfs_shim_push): the same steps as _push_in_python, without
        the GIL and with no Python object per file."""
        assert self._index is not None
        order, start = self._index
        res = shim.push(fd, lookups.fileno(), order, start[shard],
                        start[shard + 1] - start[shard], self._tree.parent, self._mountpoint,
                        counts)
        stats = self.stats
        stats.looked_up += counts.looked_up
        stats.files += counts.files
        stats.bytes += counts.bytes
        stats.listed += counts.listed
        stats.dirs_listed += counts.dirs_listed
        stats.opened += counts.opened
        stats.unknown += counts.unknown
        stats.errors += counts.errors
        if counts.off:
            log.info("the kernel does not take pushed pages (ENOSYS): off")
            self._off = True
        if -res in GONE:
            self._lookups_gone()
        elif res != 0:  # the mount is going away, or the cache file is gone
            log.debug("pushing pages stopped: %s", os.strerror(-res))

    def _push_in_python(self, fd: int, lookups: socket.socket, shard: int) -> None:
        stats, tree = self.stats, self._tree
        assert self._index is not None
        try:
            order, start = self._index
            for pos in order[start[shard] : start[shard + 1]]:
                ino, offset, size = pos + 1, tree.offset[pos], tree.size[pos]
                if size == 0:
                    continue
                if shim.was_read(ino):
                    stats.opened += 1
                    continue
                listed = self._has_inode(ino)
                if listed and not shim.metadata_in_c():
                    stats.opened += 1  # no marks: an inode means a reader looked it up
                    continue
                if not listed and self._list_parent(lookups, ino):
                    listed = self._has_inode(ino)
                if not listed and not self._look_up(lookups, ino):
                    stats.unknown += 1
                    continue
                at = 0
                while at < size:
                    n = min(PIECE, size - at)
                    data = os.pread(fd, n, offset + at)
                    if len(data) != n:
                        raise OSError(errno.EIO, f"short read of a cached shard ({len(data)} "
                                                 f"of {n} bytes)")
                    if not self._store(ino, at, data):
                        if not self._off:
                            stats.unknown += 1  # its inode went away meanwhile
                        break
                    at += n
                else:
                    stats.files += 1
                    stats.listed += listed
                    stats.bytes += size
                if self._off:
                    return
        except OSError as exc:  # the mount is going away, the cache file or lookups gone
            stats.errors += 1
            if exc.errno in GONE:
                self._lookups_gone()
            else:
                log.debug("pushing pages stopped: %s", exc)

    def _lookups_gone(self) -> None:
        log.warning("the page push's lookup process ended: pushing pages is off")
        self._off = True

    def _has_inode(self, ino: int) -> bool:
        """Does the kernel have this inode (was the file looked up)? A zero-length store
        copies nothing and fails with ENOENT when it has not."""
        return self._store(ino, 0, b"")

    def _list_parent(self, lookups: socket.socket, ino: int) -> bool:
        """Where listings give inodes, have the file's directory listed by the lookup process,
        once: its files' inodes for one request per ~300 entries, not a stat per file (the
        shim's loop does the same). Whether it was listed now."""
        parent = self._tree.parent[ino - 1] + 1
        if parent in self._dirs_asked or not shim.listings_give_inodes():
            return False
        self._dirs_asked.add(parent)
        path = self._tree.path(parent)
        if look_up(lookups, self._mountpoint + b"/" + path + (b"/" if path else b"")):
            self.stats.dirs_listed += 1
        return True

    def _look_up(self, lookups: socket.socket, ino: int) -> bool:
        """The LOOKUP that gives the kernel an inode for the file: a stat through the mount,
        by the lookup process."""
        if not look_up(lookups, self._mountpoint + b"/" + self._tree.path(ino)):
            return False
        self.stats.looked_up += 1
        return True

    def _store(self, ino: int, pos: int, data: bytes) -> bool:
        """notify_store; False when the kernel has no inode for `ino` (ENOENT) or takes no
        pushed pages at all (ENOSYS: then _off)."""
        try:
            pyfuse3.notify_store(ino, pos, data)
            return True
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                log.info("the kernel does not take pushed pages (ENOSYS): off")
                self._off = True
                return False
            if exc.errno == errno.ENOENT:
                return False
            raise
