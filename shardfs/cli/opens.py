"""Count the files read through a mount, page-cache hits included, with inotify.

The daemon sees only the reads the kernel sends it; a file whose pages are in the page cache
(read before, or pushed there after its shard arrived) is read without a word to shardfs. The
kernel still tells inotify watchers of every close of a file opened for reading, so `shardfs
top` watches the mount's directories while it runs (nothing is counted, and nothing costs,
when nobody watches): files closed after reading, and the bytes of those files (their size,
from the kernel's attribute cache: no request to the daemon; above ~600 files/s, from a sample
of them). A file opened and read only in
part counts whole; ImageFolder-style loaders read whole files.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import random
import select
import struct
import threading

IN_CLOSE_NOWRITE = 0x10
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then the name, NUL padded)
BATCH_S = 0.05  # seconds between reads of the event queue while files are read
STAT_SAMPLE = 32  # files stat'ed per batch for their sizes (see _count)
MAX_DIRS = 50_000  # a tree with more directories is not watched (inotify watches are per user)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class OpenCounter:
    """Files read (closed after reading) under `root`, and their bytes, since start()."""

    def __init__(self, root: str, max_dirs: int = MAX_DIRS) -> None:
        self.root = os.fsencode(root)
        self.max_dirs = max_dirs
        self.files = 0
        self.bytes = 0
        self.overflows = 0  # the kernel's event queue overflowed: counts are low
        self.watching = False  # every directory has a watch
        self.error: str | None = None  # why files are not counted
        self._dirs: dict[int, bytes] = {}
        self._fd = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            self.error = f"inotify: {os.strerror(ctypes.get_errno())}"
            return
        self._fd = fd
        self._thread = threading.Thread(target=self._run, name="opens", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop counting. The thread closes the descriptor itself when it ends: it may be
        stuck in a request to a daemon that hangs, and waiting for it would hang us too."""
        self._stop.set()

    # -- the watcher thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._watch_tree():
                self.watching = True
            while not self._stop.is_set():
                ready, _, _ = select.select([self._fd], [], [], 0.2)
                if ready:
                    # Let events gather: woken per event, this thread cost ~80 us of CPU per
                    # file read; the kernel queues 16384 (0.3 s at 50k files/s).
                    self._stop.wait(BATCH_S)
                    self._drain()
        finally:
            os.close(self._fd)

    def _watch_tree(self) -> bool:
        """A watch on every directory (found through the listing: no per-file requests)."""
        pending = [self.root]
        while pending and not self._stop.is_set():
            path = pending.pop()
            if len(self._dirs) >= self.max_dirs:
                self.error = f"more than {self.max_dirs} directories: page-cache reads not " \
                             "counted"
                return False
            wd = _libc.inotify_add_watch(self._fd, path, IN_CLOSE_NOWRITE | IN_ONLYDIR)
            if wd < 0:
                err = ctypes.get_errno()
                if err == errno.ENOSPC:
                    self.error = "out of inotify watches (fs.inotify.max_user_watches): " \
                                 "page-cache reads not counted"
                    return False
                continue  # gone or not readable: skip it
            self._dirs[wd] = path
            try:
                with os.scandir(path) as entries:
                    pending.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
            self._drain()  # keep the queue short while the walk goes on
        return True

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                return
            closed: list[bytes] = []
            pos = 0
            while pos + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size:pos + _EVENT.size + length].rstrip(b"\0")
                pos += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    self.overflows += 1
                elif mask & IN_IGNORED:
                    self._dirs.pop(wd, None)
                elif mask & IN_CLOSE_NOWRITE and not mask & IN_ISDIR and name:
                    directory = self._dirs.get(wd)
                    if directory is not None:
                        closed.append(os.path.join(directory, name))
            self._count(closed)

    def _count(self, paths: list[bytes]) -> None:
        """Count files closed; their bytes from the sizes of at most STAT_SAMPLE of them per
        batch (a stat is ~15 us: at thousands of files/s, stat'ing each cost top a tenth of a
        core), the rest counted at the sample's mean size."""
        if not paths:
            return
        sample = paths if len(paths) <= STAT_SAMPLE else random.sample(paths, STAT_SAMPLE)
        total = 0
        for path in sample:
            with contextlib.suppress(OSError):
                total += os.stat(path, follow_symlinks=False).st_size
        self.files += len(paths)
        self.bytes += total * len(paths) // len(sample)
