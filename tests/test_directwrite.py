"""Part-file writes past the page cache (shardfs/cache/directwrite.py), on real files: the
runs land byte for byte, their aligned middles are not left in the page cache, a run's
unaligned head or tail goes through it, a failed write reaches its writer, and a disk that
stalls (a file system frozen by fsfreeze) holds no writer until its allowance is full."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import random
import subprocess
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


async def _written(direct: DirectWrites, staged, direct_fd: int, fd: int) -> OSError | None:
    """Submit a run, as a fill's GET does, and wait for the writer's report of it."""
    done = trio.Event()
    report: list[OSError | None] = []

    def on_done(error: OSError | None) -> None:
        report.append(error)
        done.set()

    await direct.submit(staged, direct_fd, fd, on_done)
    await done.wait()
    return report[0]


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
                    assert await _written(direct, staged, direct_fd, fd) is None
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
            failed = await _written(direct, staged, read_only, fd)  # not open for writing
            assert failed is not None and failed.errno == errno.EBADF
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        for each in (fd, direct_fd, read_only):
            os.close(each)
        direct.close()


def test_a_stalled_disk_holds_no_writer_until_its_allowance_is_full(loop_disks) -> None:
    """Runs handed to the writer while the disk takes nothing (its file system frozen) are
    taken at once up to `pending_max` bytes, none reported written; the next waits for room;
    once the disk thaws every run is written and reported, byte for byte. (Before, every
    writer waited for its run to be on the disk: a fill's GETs stopped with the disk.)"""
    disk = loop_disks("cache")
    path = disk.path / "part"
    data = os.urandom(6 * PIECE)
    direct, fd, direct_fd = _direct(path, len(data))
    direct.pending_max = 4 * PIECE
    frozen = subprocess.run(["fsfreeze", "--freeze", str(disk.path)], capture_output=True,
                            text=True)
    if frozen.returncode != 0:
        os.close(fd)
        os.close(direct_fd)
        pytest.skip(f"fsfreeze: {frozen.stderr.strip()}")
    done: list[tuple[int, OSError | None]] = []

    def staged(i: int):
        run = direct.stage(i * PIECE)
        run.add(data[i * PIECE : (i + 1) * PIECE])
        return run

    async def submit(i: int) -> None:
        await direct.submit(staged(i), direct_fd, fd,
                            lambda error: done.append((i, error)))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            direct.start(nursery)
            try:
                with trio.fail_after(20):  # (a writer waiting for the disk: never returns)
                    for i in range(4):
                        await submit(i)
                await trio.sleep(0.3)
                assert done == [] and direct.pending == 4 * PIECE  # the disk took nothing
                with trio.move_on_after(0.5) as waited:
                    await submit(4)  # over the allowance: waits for the disk
                assert waited.cancelled_caught and direct.pending == 4 * PIECE
            finally:
                subprocess.run(["fsfreeze", "--unfreeze", str(disk.path)], capture_output=True)
            with trio.fail_after(20):
                await submit(4)
                await submit(5)
                while len(done) < 6:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert sorted(done) == [(i, None) for i in range(6)] and direct.pending == 0
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(disk.path)], capture_output=True)
        os.close(fd)
        os.close(direct_fd)
        direct.close()


def test_no_direct_writes_to_a_tmpfs(tmpfs: Path) -> None:
    """A tmpfs is memory: no alignment is given, and fills write as before."""
    fd = os.open(tmpfs / "part", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert dio_alignment(fd) is None and DirectWrites.probe(fd) is None
    finally:
        os.close(fd)
