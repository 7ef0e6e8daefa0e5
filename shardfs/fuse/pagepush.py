"""Fetched shards' files pushed into the kernel's page cache (FUSE_NOTIFY_STORE).

Why: in a cold shuffled epoch almost every file is read after its shard has arrived — the
DataLoader's 4 workers each wait on one file at a time, so little is read while bytes are
still coming (docs/benchmarks.md, "Cold shuffled epoch: files read before the last byte").
Each such read is a FUSE READ the daemon answers (~2,400 files/s at bench scale 3), while
pages already in the page cache are answered by the kernel alone (~6,300 files/s). So, as each
shard completes, its files' bytes go into the page cache of their inodes, while the readers
still wait on the link.

When (`worth_pushing`): only without OPEN requests (the shim in effect: pages then survive
every open of the file), and only when the dataset fits both the cache budget and a quarter of
the machine's memory. Pushed pages are the pages a full pass over the files leaves in the
page cache anyway (docs/pyfuse3.md, "Members cached twice?"), only earlier; they are clean and
reclaimable.

How: one shard at a time, in the order they complete, in a worker thread: `notify_store`
waits while the kernel holds a page locked for a READ that this process may be the one to
answer. The kernel takes pages only for inodes it has: listings are plain READDIR
(docs/tuning.md), so a file nobody has looked up yet has none, and the kernel answers ENOENT.
The pusher then looks the file up itself (a `stat` through the mount, answered in C like any
LOOKUP) and pushes again: the LOOKUP the reader's `open` would have sent anyway, made earlier
and off the reader's path (its `open` then finds the cached entry).
"""

from __future__ import annotations

import errno
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import pyfuse3  # after the shim: shardfs.fuse's __init__ loads it first
import trio

from shardfs.read.cache import ShardCache

log = logging.getLogger(__name__)

PIECE = 4 << 20  # larger files are pushed in pieces of this size (bounded memory)


def worth_pushing(no_open: bool, dataset_bytes: int, cache_budget: int) -> bool:
    """Push completed shards into the page cache? See the module's docstring."""
    if not no_open or dataset_bytes > cache_budget:
        return False
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return False
    return dataset_bytes <= memory // 4


@dataclass(slots=True)
class PushStats:
    shards: int = 0  # shards whose files were pushed
    skipped_shards: int = 0  # not pushed: already read as they arrived (shard_complete)
    files: int = 0
    bytes: int = 0
    looked_up: int = 0  # files the kernel had no inode for, looked up by the pusher
    unknown: int = 0  # files it still had no inode for after that: skipped
    errors: int = 0


class PagePusher:
    def __init__(self, files: dict[int, list[tuple[int, int, int]]], cache: ShardCache,
                 keys: list[str], mountpoint: str, path_of: Callable[[int], bytes],
                 reads_of: Sequence[int]) -> None:
        self._files = files  # shard -> [(inode, offset in shard, size)], from the tree
        self._cache = cache
        self._keys = keys
        self._mountpoint = os.fsencode(mountpoint)
        self._path_of = path_of  # inode -> path below the mountpoint (Tree.path)
        self._reads_of = reads_of  # shard -> reads of it seen so far (Reader.reads_of)
        self._queue: deque[int] = deque()
        self._wake = trio.Event()
        self._off = False  # the kernel does not support it: stop
        self.stats = PushStats()

    def shard_complete(self, shard: int) -> None:
        """Reader.on_complete: queue a shard that has just arrived whole — unless its readers
        kept up with its arrival: when reads of it already number half its files, most of its
        files are in the page cache from those reads, and pushing them again would only cost
        (bench node, 8 readers, cold from file://: 7,424 files/s pushing every shard against
        11,852 without)."""
        files = self._files.get(shard)
        if files is None or self._off:
            return
        if 2 * self._reads_of[shard] >= len(files):
            self.stats.skipped_shards += 1
            return
        self._queue.append(shard)
        self._wake.set()

    def snapshot(self) -> dict[str, int]:
        return asdict(self.stats)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()
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
            await trio.to_thread.run_sync(self._push, fd, self._files[shard],
                                          abandon_on_cancel=True)
            self.stats.shards += 1

    def _push(self, fd: int, files: list[tuple[int, int, int]]) -> None:
        """In a worker thread: the files' bytes from the shard's cache file to the kernel."""
        stats = self.stats
        try:
            for ino, offset, size in files:
                pos = 0
                while pos < size:
                    n = min(PIECE, size - pos)
                    data = os.pread(fd, n, offset + pos)
                    if len(data) != n:
                        raise OSError(errno.EIO, f"short read of a cached shard ({len(data)} "
                                                 f"of {n} bytes)")
                    if not self._store(ino, pos, data):
                        if self._off:
                            return
                        stats.unknown += 1
                        break
                    pos += n
                else:
                    stats.files += 1
                    stats.bytes += size
        except OSError as exc:  # the mount is going away, or the cache file is gone
            stats.errors += 1
            log.debug("pushing pages stopped: %s", exc)
        finally:
            os.close(fd)

    def _store(self, ino: int, pos: int, data: bytes) -> bool:
        """notify_store, looking the file up first if the kernel has no inode for it; False:
        not stored (still no inode, or the kernel does not take pushed pages: _off)."""
        try:
            pyfuse3.notify_store(ino, pos, data)
            return True
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                log.info("the kernel does not take pushed pages (ENOSYS): off")
                self._off = True
                return False
            if exc.errno != errno.ENOENT:
                raise
        try:  # the LOOKUP that gives the kernel an inode for it
            os.stat(self._mountpoint + b"/" + self._path_of(ino))
        except OSError:
            return False
        self.stats.looked_up += 1
        try:
            pyfuse3.notify_store(ino, pos, data)
            return True
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return False
