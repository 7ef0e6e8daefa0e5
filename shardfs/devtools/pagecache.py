"""Evicting a file's pages from the kernel's page cache, for tests and benchmarks that need a
read to reach the disk or the FUSE daemon again (a mount keeps file pages across opens)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_pages(path: str | Path) -> None:
    """posix_fadvise(DONTNEED) the whole file: its clean pages leave the page cache (FUSE
    files included; no privilege needed, unlike /proc/sys/vm/drop_caches)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
