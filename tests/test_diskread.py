"""Reads of cache files (shardfs/read/diskread.py): whole or ReadError, never short."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from shardfs.read.diskread import DiskReads
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
