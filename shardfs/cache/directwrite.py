"""Part-file writes that bypass the page cache (O_DIRECT), for bytes kept elsewhere anyway.

A `Lookahead` fill (read/lookahead.py) lands each member's bytes in the shared arena, where
the mount's reads take them, *and* writes them into the shard's part file for later epochs.
Written through the page cache, that second copy allocates a fresh page-cache page per 4 KiB:
on the 2-core test VM this copy into new pages was the largest single cost of a `Lookahead`
epoch's daemon (`pwrite` 26.6 % of its samples, docs/benchmarks-notes.md "Where a `Lookahead`
epoch's daemon CPU goes"), and on any machine it keeps the shard's bytes in memory twice (the
cache file's pages beside the mount's own). With O_DIRECT the bytes go from one reused,
aligned buffer to the disk; the page cache holds them once, as the mount's pages.

O_DIRECT asks for aligned writes: the buffer's address, the file offset and the length
each a multiple of what the file system says (`statx` STATX_DIOALIGN; 512 bytes on most
disks). A tar member's extent (its headers and its data, padded: read/layout.py) starts and
ends on 512-byte boundaries, so a fill's GETs are aligned; a run's unaligned head or tail
(another archive format, a shard's odd end) is written through the page cache, which the file
system keeps coherent with the direct writes beside it.

Not used where the file system gives no alignment (tmpfs: it is memory anyway), where an
O_DIRECT open fails, or with SHARDFS_FILL_BUFFERED=1 (to measure one against the other).

A GET hands its full buffers to the writer and goes on receiving (`submit`): the disk's time
is not the link's. A disk that stalls for a moment (this VM's did for 0.1-0.3 s, once 1.3 s,
in a 3.6 s epoch) stopped every fill GET while they waited for their writes, and with them the
link (docs/benchmarks-notes.md, "Fill GETs that do not wait for the disk"). Up to
PENDING_MAX bytes may wait for the disk; past that a GET waits too, so a disk slower than the
link slows the fill rather than filling memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
from collections.abc import Callable

import trio

from shardfs.util.fileio import pwrite_all

log = logging.getLogger(__name__)

# Bytes gathered before one direct write: a fill's GET is usually smaller (~190 KB at bench
# scale 3). The buffers take at most ~16 MiB for its 64 GETs in flight plus PENDING_MAX for
# the writes waiting for the disk; POOL_KEEP of them are kept for reuse.
PIECE = 256 << 10
POOL_KEEP = 64  # idle buffers kept for the next GETs (the rest are unmapped)
# Bytes handed to the writer and not yet on the disk before a GET waits for them: ~0.6 s of a
# 100 MB/s link's bytes while the disk takes none.
PENDING_MAX = 64 << 20

_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256
_DIO_MEM_ALIGN_AT = 152  # struct statx: stx_dio_mem_align, then stx_dio_offset_align (u32s)
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def dio_alignment(fd: int) -> int | None:
    """The alignment (bytes) an O_DIRECT write to this open file needs for its buffer, offset
    and length; None when the file system does not say (no direct I/O, or a kernel before
    6.1)."""
    statx = getattr(_libc, "statx", None)
    if statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    mem = int.from_bytes(buf.raw[_DIO_MEM_ALIGN_AT : _DIO_MEM_ALIGN_AT + 4], "little")
    offset = int.from_bytes(buf.raw[_DIO_MEM_ALIGN_AT + 4 : _DIO_MEM_ALIGN_AT + 8], "little")
    if not mask & _STATX_DIOALIGN or not mem or not offset:
        return None
    align = max(mem, offset)
    # A power of two that divides the pool's page-aligned buffers and PIECE.
    return align if align & (align - 1) == 0 and align <= mmap.PAGESIZE else None


class DirectWrites:
    """The O_DIRECT writes of one cache directory: its alignment, a pool of aligned buffers
    that GETs gather their bytes in (reused: no fresh memory per GET), and the one task that
    writes them (`start`), in batches: a worker thread per batch, not per GET (a thread's
    round trip cost about as much CPU here as the direct write itself)."""

    def __init__(self, align: int, pending_max: int = PENDING_MAX) -> None:
        self.align = align
        self.pending_max = pending_max
        self.pending = 0  # bytes submitted and not yet on the disk
        self._idle: list[mmap.mmap] = []
        self._queue: list[_Write] = []
        self._wake = trio.Event()
        self._room = trio.Event()  # set when a batch is done: `pending` went down
        self._running = False

    @classmethod
    def probe(cls, fd: int) -> DirectWrites | None:
        """For the file system of an open part file: None where direct writes are not used."""
        if os.environ.get("SHARDFS_FILL_BUFFERED"):
            return None
        align = dio_alignment(fd)
        return None if align is None else cls(align)

    def open(self, path: os.PathLike[str] | str) -> int | None:
        """A second descriptor of a part file, for direct writes; None (said in the log) when
        the file system refuses O_DIRECT."""
        try:
            return os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            log.info("no direct writes to %s (%s): through the page cache", path, exc)
            return None

    def stage(self, at: int) -> Staged:
        """A buffer for bytes from file offset `at` on."""
        buffer = self._idle.pop() if self._idle else mmap.mmap(-1, PIECE)
        return Staged(buffer, at, self.align)

    def start(self, nursery: trio.Nursery) -> None:
        """Start the writer task in `nursery` (once: later calls do nothing)."""
        if not self._running:
            self._running = True
            nursery.start_soon(self._run)

    async def _run(self) -> None:
        """Write what `write` queues, until cancelled (the daemon's end: a batch being
        written is finished first; runs still queued are dropped, their buffers too)."""
        batch: list[_Write] = []
        try:
            while True:
                if not self._queue:
                    self._wake = trio.Event()
                    await self._wake.wait()
                batch, self._queue = self._queue, []
                await trio.to_thread.run_sync(_write_batch, batch,
                                              thread_name="shardfs direct writes")
                self._finish(batch)
                batch = []
        finally:
            self._running = False  # (a later `start` starts another)
            for item in self._queue:
                item.error = OSError(errno.ECANCELED, "not written: the daemon is ending")
                _close(item)
            self._finish(batch + self._queue)
            self._queue.clear()

    def _finish(self, items: list[_Write]) -> None:
        """Items the writer is done with (written, failed or dropped): buffers back to the
        pool, their submitters told."""
        for item in items:
            self.pending -= item.staged.size
            self.release(item.staged)
            try:
                item.on_done(item.error)
            except Exception:  # a bug in the submitter's callback: not the writer's end
                log.exception("a direct write's completion failed")
        self._room.set()

    async def submit(self, staged: Staged, direct_fd: int, fd: int,
                     on_done: Callable[[OSError | None], None]) -> None:
        """Hand a staged run to the writer (its aligned middle through `direct_fd`, an
        unaligned head or tail through `fd`) and return: at once, unless `pending_max` bytes
        wait for the disk already (then once fewer do). `on_done(None)` is called once the
        run is on the disk, `on_done(OSError)` if it is not (also when the daemon ends first),
        from the writer's task. The writer owns the buffer from here, also when the caller
        is cancelled; it writes through duplicates of the descriptors, so the caller may
        close its own meanwhile. The writer task must be started (`start`)."""
        while self.pending >= self.pending_max:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()
        item = _Write(staged, os.dup(direct_fd), os.dup(fd), on_done)
        self.pending += staged.size
        self._queue.append(item)
        self._wake.set()

    def release(self, staged: Staged) -> None:
        if len(self._idle) < POOL_KEEP:
            self._idle.append(staged.buffer)
        else:
            staged.buffer.close()

    def close(self) -> None:
        for buffer in self._idle:
            buffer.close()
        self._idle.clear()


class Staged:
    """Bytes of a file run [at, at + len) gathered in an aligned buffer: the byte at file
    offset f sits at f - base, base being `at` rounded down to the alignment, so the run's
    aligned middle is written straight from the buffer. Full at the buffer's end (an aligned
    file offset: the next run starts aligned)."""

    __slots__ = ("align", "at", "base", "buffer", "end")

    def __init__(self, buffer: mmap.mmap, at: int, align: int) -> None:
        self.buffer, self.align = buffer, align
        self.at = self.end = at
        self.base = at - at % align

    @property
    def room(self) -> int:
        return self.base + len(self.buffer) - self.end

    @property
    def size(self) -> int:
        return self.end - self.at

    def add(self, data: bytes | memoryview) -> int:
        """Take as much of `data` as fits; how much was taken."""
        n = min(len(data), self.room)
        start = self.end - self.base
        self.buffer[start : start + n] = data[:n] if n < len(data) else data
        self.end += n
        return n

    def write(self, direct_fd: int, fd: int) -> None:
        """Write the run: its aligned middle through `direct_fd` (O_DIRECT), an unaligned head
        or tail through `fd`. Blocking (the disk's time): call it in a worker thread."""
        align = self.align
        lo = -(-self.at // align) * align  # the aligned middle [lo, hi)
        hi = self.end - self.end % align
        with memoryview(self.buffer) as view:
            if hi > lo:
                if lo > self.at:
                    pwrite_all(fd, view[self.at - self.base : lo - self.base], self.at)
                # (a short write, a full disk, leaves the rest aligned or fails on: OSError)
                pwrite_all(direct_fd, view[lo - self.base : hi - self.base], lo)
                if self.end > hi:
                    pwrite_all(fd, view[hi - self.base : self.end - self.base], hi)
            elif self.end > self.at:  # no aligned block in it: all through the page cache
                pwrite_all(fd, view[self.at - self.base : self.end - self.base], self.at)


class _Write:
    __slots__ = ("direct_fd", "error", "fd", "on_done", "staged")

    def __init__(self, staged: Staged, direct_fd: int, fd: int,
                 on_done: Callable[[OSError | None], None]) -> None:
        self.staged, self.direct_fd, self.fd = staged, direct_fd, fd
        self.on_done = on_done
        self.error: OSError | None = None


def _write_batch(batch: list[_Write]) -> None:
    """In a worker thread: each run, its error kept for its writer; the descriptors closed."""
    for item in batch:
        try:
            item.staged.write(item.direct_fd, item.fd)
        except OSError as exc:  # kept without its traceback, whose frames hold the buffer
            item.error = OSError(exc.errno, exc.strerror)
        except Exception as exc:  # a bug: the run's fill fails, not the writer
            item.error = OSError(errno.EIO, f"direct write failed: {exc!r}")
        finally:
            _close(item)


def _close(item: _Write) -> None:
    os.close(item.direct_fd)
    os.close(item.fd)
