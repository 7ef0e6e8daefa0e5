"""A file's pages in the kernel's page cache, for tests and benchmarks: evicting them (so that
a read reaches the disk or the FUSE daemon again; a mount keeps file pages across opens), and
asking how many are there."""

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


def resident_pages(path: str | Path) -> tuple[int, int]:
    """(pages of the file in the page cache, pages it has), by mincore(2) over a read-only
    mapping: asking reads nothing (a FUSE file's daemon sees no request)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        if pages == 0:
            return 0, 0
        at = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if at in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(at, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(b & 1 for b in vec.raw), pages
        finally:
            libc.munmap(at, size)
    finally:
        os.close(fd)
