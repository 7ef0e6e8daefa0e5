"""Writing and reading file ranges whole (short writes and reads are errors, not holes)."""

from __future__ import annotations

import errno
import os


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


def pread_all(fd: int, size: int, offset: int) -> bytes:
    """`size` bytes at `offset`, or OSError (EIO) where the file ends before them."""
    data = os.pread(fd, size, offset)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            raise OSError(errno.EIO, f"file ends at {offset + got}, {size - got} bytes short")
        parts.append(more)
        got += len(more)
    return b"".join(parts)
