"""Reading cache files without stalling the loop that answers FUSE requests.

A `pread` of bytes in the page cache takes microseconds; one that misses it waits for the disk,
and on the one thread that serves every request that wait would hold up all of them. So each
read first asks for the bytes with RWF_NOWAIT (the kernel answers EAGAIN instead of waiting),
and only a read that would block goes to a worker thread, where many disk reads can be in
flight at once.

A read that misses the page cache also asks the kernel to read the READ_AROUND bytes around it
(posix_fadvise WILLNEED, given in the disk thread: it starts the I/O, but makes the window's
new pages before it returns). A cache file is one shard, whose members a
shuffled epoch reads in random order: once the page cache has lost the shard (memory
pressure, drop_caches), one large sequential read brings back the neighbours of the missed
member too, and their reads are answered inline instead of one random disk read each.
"""

from __future__ import annotations

import contextlib
import errno
import os

import trio

from shardfs.read.errors import ReadError
from shardfs.util.fstypes import memory_backed

# Threads doing blocking disk reads at once: enough to keep an NVMe queue busy.
DISK_THREADS = 32
# Bytes read around a read that missed the page cache (aligned to this size).
READ_AROUND = 8 << 20

# How a read of a file learns, without waiting, whether its bytes are in memory, by the file
# system under it (`read_mode`; the shim's C reads go by it: struct fast_arrays' mode in
# _shim_meta.c): RWF_NOWAIT; a plain pread where the file system refuses RWF_NOWAIT and
# holds its files in memory (tmpfs); mincore over a mapping of the file, then a plain
# pread, where it refuses RWF_NOWAIT and does not (overlayfs).
READ_NOWAIT, READ_PLAIN, READ_MINCORE = 0, 1, 2


def read_mode(fd: int) -> int:
    """READ_NOWAIT where `fd`'s file system takes RWF_NOWAIT; else READ_PLAIN where it holds
    its files in memory (tmpfs), READ_MINCORE where not (overlayfs)."""
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
    except BlockingIOError:
        return READ_NOWAIT
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:
            return READ_PLAIN if memory_backed(fd) else READ_MINCORE
    return READ_NOWAIT


def read_if_cached(fd: int, size: int, offset: int) -> bytes | bytearray | None:
    """The bytes if the page cache holds all of them, else None (never blocks on the disk).
    A file system without RWF_NOWAIT: plain `pread` where its files are held in memory
    (tmpfs: nothing to wait for), else None (a thread reads it: overlayfs and the like, whose
    reads the shim's C asks mincore about instead, `READ_MINCORE`)."""
    buf = bytearray(size)
    try:
        n = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:  # EOPNOTSUPP: a file system without RWF_NOWAIT
        if exc.errno != errno.EOPNOTSUPP or not memory_backed(fd):
            return None
        n = os.preadv(fd, [buf], offset)
    return buf if n == size else None  # partly cached (or short): a thread reads it whole


def _read_around_and_close(fd: int, size: int, offset: int) -> bytes:
    """In a disk thread: ask for the READ_AROUND window around `offset`, then read the
    bytes (they are in it); closes `fd`. The advice is not given on the loop's thread:
    WILLNEED allocates the window's page-cache pages (2,048 of them) before it returns, and
    on this test VM that cost 3-27 ms of the loop's CPU each time (docs/benchmarks-notes.md,
    "The read-around's pages made off the loop")."""
    try:
        with contextlib.suppress(OSError):  # only advice
            os.posix_fadvise(fd, offset - offset % READ_AROUND, READ_AROUND,
                             os.POSIX_FADV_WILLNEED)
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


class DiskReads:
    """Reads of cache files for one event loop, counted by how they were served."""

    def __init__(self, threads: int = DISK_THREADS) -> None:
        self._limiter = trio.CapacityLimiter(threads)
        self.inline = 0  # served from the page cache without leaving the loop
        self.threaded = 0  # went to a thread because they would have waited for the disk
        self.in_c = 0  # answered by the shim in C from the page cache (fuse/fastread.py)

    async def pread(self, fd: int, size: int, offset: int) -> bytes | bytearray:
        """`size` bytes at `offset` of `fd`: from the page cache inline, else in a thread;
        ReadError if the file ends before them.

        The thread reads a duplicate of `fd`: the original may be closed meanwhile (the shard
        evicted, a fetch aborted) and its number reused, while the duplicate still names the
        same file, whose bytes at a given offset never change once written."""
        data = read_if_cached(fd, size, offset)
        if data is not None:
            self.inline += 1
            return data
        dup = os.dup(fd)
        self.threaded += 1
        data = await trio.to_thread.run_sync(_read_around_and_close, dup, size, offset,
                                             limiter=self._limiter, thread_name="shardfs disk")
        if len(data) < size:
            # Bytes a cache file holds never go, but a shard read in place (read/inplace.py)
            # is the user's file: cut short, its members must fail, not read short.
            raise ReadError(f"{len(data)} of {size} bytes at {offset}: the shard's file is "
                            "shorter than its index says (cut short while mounted?)")
        return data
