"""Reads of cache files (shardfs/read/diskread.py): whole or ReadError, never short."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import trio

from shardfs.read.diskread import DiskReads, read_if_cached
from shardfs.read.errors import ReadError


@pytest.mark.parametrize("cached", [True, False], ids=["page cache", "disk"])
def test_a_file_cut_short_after_it_was_opened_fails_the_read(tmp_path: Path,
                                                             cached: bool) -> None:
    """A shard read in place whose file is truncated while a process holds it open: the bytes
    past the new end fail with ReadError (EIO), from the page cache and from a thread alike;
    the bytes before it read whole."""
    path = tmp_path / "shard.tar"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    fd = os.open(path, os.O_RDONLY)
    try:
        os.truncate(path, 10_000)
        if not cached:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        reads = DiskReads()

        async def read(size: int, offset: int) -> bytes | bytearray:
            return await reads.pread(fd, size, offset)

        assert trio.run(read, 1000, 9000) == (bytes(range(256)) * 64)[9000:10_000]
        with pytest.raises(ReadError, match="shorter than its index says"):
            trio.run(read, 4096, 8192)
        with pytest.raises(ReadError):
            trio.run(read, 100, 12_000)  # wholly past the end
    finally:
        os.close(fd)


def _cached(fd: int, offset: int) -> bool:
    """Whether the page at `offset` is in the page cache (a read that would not wait)."""
    return read_if_cached(fd, 4096, offset) is not None


def test_a_read_from_the_disk_brings_its_window_in_and_the_loop_gives_no_advice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that misses the page cache asks for the READ_AROUND window around it: a
    neighbour in that window comes into the page cache without being read, one in the next
    window does not. The advice (WILLNEED makes the window's pages before it returns) is
    given by the thread that reads, never by the loop's thread."""
    from shardfs.read import diskread

    window = diskread.READ_AROUND
    path = tmp_path / "shard.tar"
    data = os.urandom(2 * window)
    path.write_bytes(data)
    advised_on: list[int] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        advised_on.append(threading.get_ident())
        real_fadvise(fd, offset, length, advice)

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _cached(fd, window // 2 + 4096):
            pytest.skip("this file system keeps the file in memory (no page cache to drop)")
        monkeypatch.setattr(diskread.os, "posix_fadvise", fadvise)
        reads = DiskReads()
        loop_thread = threading.get_ident()

        async def read() -> bytes | bytearray:
            return await reads.pread(fd, 4096, 4096)

        assert trio.run(read) == data[4096:8192]
        assert reads.threaded == 1
        assert advised_on and loop_thread not in advised_on
        neighbour, next_window = window - 8192, window + window // 2
        deadline = time.monotonic() + 10
        while not _cached(fd, neighbour) and time.monotonic() < deadline:
            time.sleep(0.01)  # the advice only starts the I/O
        assert _cached(fd, neighbour)
        assert not _cached(fd, next_window)
    finally:
        os.close(fd)
