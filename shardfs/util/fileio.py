"""Writing and reading file ranges whole (short writes and reads are errors, not holes)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of `data` at `offset`, or raise OSError.

    os.pwrite() on a filesystem that fills up mid-write writes a part and returns its length
    without an error. Ignoring that return value left holes of zeros in a shard that readers
    were then served from its frontier and that commit() made "complete" (issue #7)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        offset += n


VIEW_BYTES = 1 << 20  # what file_views reads at once
_this_thread = threading.local()


def file_views(fd: int, offset: int, size: int) -> Iterator[memoryview]:
    """Bytes [offset, offset + size) of a file, as views of a buffer this thread reuses,
    VIEW_BYTES at a time; OSError (EIO) where the file ends first. A view is valid until the
    next one is taken: for checks that consume each at once (a digest). No fresh memory per
    piece (faulted in, zeroed and given back by a many-threaded process: docs/benchmarks-notes.md,
    "Downloads spliced into the cache")."""
    buffer = getattr(_this_thread, "buffer", None)
    if buffer is None:
        buffer = _this_thread.buffer = memoryview(bytearray(VIEW_BYTES))
    end = offset + size
    while offset < end:
        n = os.preadv(fd, [buffer[: min(VIEW_BYTES, end - offset)]], offset)
        if n <= 0:
            raise OSError(errno.EIO, f"file ends at {offset}, {end - offset} bytes short")
        yield buffer[:n]
        offset += n
