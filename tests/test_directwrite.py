"""Part-file writes past the page cache (shardfs/cache/directwrite.py), on real files: the
runs land byte for byte, their aligned middles are not left in the page cache, a run's
unaligned head or tail goes through it, and a failed write reaches its writer."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import random
from pathlib import Path

import pytest
import trio

from shardfs.cache.directwrite import PIECE, DirectWrites, dio_alignment
from shardfs.devtools.pagecache import resident_pages


def _direct(path: Path, size: int) -> tuple[DirectWrites, int, int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, size)
    direct = DirectWrites.probe(fd)
    if direct is None:
        os.close(fd)
        pytest.skip(f"no direct I/O on {path.parent} (or SHARDFS_FILL_BUFFERED is set)")
    direct_fd = direct.open(path)
    assert direct_fd is not None
    return direct, fd, direct_fd


def _write_runs(direct: DirectWrites, fd: int, direct_fd: int, data: bytes,
                cuts: list[int]) -> None:
    """Each run [a, b) gathered as a GET gathers it (pieces of a buffer) and written."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            direct.start(nursery)
            for a, b in itertools.pairwise(cuts):
                pos = a
                while pos < b:
                    staged = direct.stage(pos)
                    while pos < b and staged.room:
                        pos += staged.add(data[pos : min(b, pos + 50_000)])
                    await direct.write(staged, direct_fd, fd)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_runs_are_written_byte_for_byte_and_their_aligned_middles_skip_the_page_cache(
        tmp_path: Path) -> None:
    size = 3 * PIECE + 12345
    data = os.urandom(size)
    path = tmp_path / "part"
    direct, fd, direct_fd = _direct(path, size)
    try:
        align = direct.align
        rng = random.Random(1)
        # aligned runs (a tar's extents), then unaligned ones (heads and tails written
        # through the page cache), up to the file's odd end
        cuts = [0, 7 * align, PIECE + 3 * align, 2 * PIECE]
        cuts += [*sorted(rng.sample(range(2 * PIECE + 1, size), 6)), size]
        _write_runs(direct, fd, direct_fd, data, cuts)
        assert os.pread(fd, size + 1, 0) == data
        # The aligned part (the first two PIECEs) was never in the page cache: only the
        # reads just now brought it in, so drop them and look again.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        _write_runs(direct, fd, direct_fd, data, cuts[:4])
        resident, pages = resident_pages(path)
        assert resident <= pages - 2 * PIECE // mmap.PAGESIZE, (resident, pages)
        assert os.pread(fd, size, 0) == data
    finally:
        os.close(fd)
        os.close(direct_fd)
        direct.close()


def test_a_failed_direct_write_reaches_its_writer(tmp_path: Path) -> None:
    path = tmp_path / "part"
    direct, fd, direct_fd = _direct(path, PIECE)
    read_only = os.open(path, os.O_RDONLY)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            direct.start(nursery)
            staged = direct.stage(0)
            staged.add(b"x" * PIECE)
            with pytest.raises(OSError) as failed:
                await direct.write(staged, read_only, fd)  # not open for writing
            assert failed.value.errno == errno.EBADF
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        for each in (fd, direct_fd, read_only):
            os.close(each)
        direct.close()


def test_no_direct_writes_to_a_tmpfs(tmpfs: Path) -> None:
    """A tmpfs is memory: no alignment is given, and fills write as before."""
    fd = os.open(tmpfs / "part", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert dio_alignment(fd) is None and DirectWrites.probe(fd) is None
    finally:
        os.close(fd)
