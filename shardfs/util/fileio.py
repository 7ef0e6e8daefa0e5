"""Writing files whole: the one helper the cache and its part records share."""

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
