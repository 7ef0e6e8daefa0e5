"""Ordered fills (the dataset fits the cache): announced members fetched in read order into
their shard's part file, driven without FUSE over real tar shards, file:// sources, a real
cache, the real reader and Lookahead wired as the daemon wires them (attach_lookahead).
The mount-level test is tests/test_lookahead.py."""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import random
import subprocess
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import crc32c
import pytest
import trio

from shardfs.cache import directwrite
from shardfs.cache.directwrite import dio_alignment
from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.catalog import Catalog
from shardfs.daemon.announce import attach_lookahead
from shardfs.read.lookahead import Lookahead, LookaheadPolicy, Stream
from shardfs.read.reader import Reader
from shardfs.sources import ShardInfo, Source, Sources, SourceSettings, Unreachable
from tests.conftest import LoopDisk
from tests.test_reader import Shards, file_inodes, run_reader, write_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Shards:
    return write_shards(tmp_path_factory.mktemp("fill") / "shards", seed=3)


class _Ranges:
    """A file source that records its GETs and fails the first `fail` of them."""

    def __init__(self, inner: Source, owner: _Sources) -> None:
        self.inner, self.owner, self.stats = inner, owner, inner.stats

    async def stat(self, url: str) -> ShardInfo:
        return await self.inner.stat(url)

    async def fetch_optional(self, url: str) -> bytes | None:
        return await self.inner.fetch_optional(url)

    async def stream(self, shard: ShardInfo, start: int, end: int) -> AsyncIterator[bytes]:
        self.owner.asked.append((shard.url, start, end))
        if self.owner.gate is not None:
            await self.owner.gate.wait()
        if self.owner.fail > 0:
            self.owner.fail -= 1
            raise Unreachable(f"{shard.url}: injected failure of [{start}, {end})")
        stream = self.inner.stream(shard, start, end)
        try:
            async for chunk in stream:
                yield chunk
                await trio.sleep(0)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Sources(Sources):
    def __init__(self, fail: int = 0) -> None:
        super().__init__(SourceSettings(chunk_size=4096))
        self.fail = fail
        self.asked: list[tuple[str, int, int]] = []
        self.gate: trio.Event | None = None  # set: GETs wait for it before their bytes

    def for_url(self, url: str) -> Source:
        return _Ranges(super().for_url(url), self)


def _refs(catalog: Catalog, inodes: dict[bytes, int], shard: int) -> list[tuple[int, int, int]]:
    """(shard, offset, size) of the shard's files (those of the tree: names later shards
    repeat are not), in a random order."""
    tree = catalog.tree
    refs = [(r.shard, r.offset, r.size) for r in (tree.file_ref(i) for i in inodes.values())
            if r.shard == shard and r.size > 0]
    random.Random(shard).shuffle(refs)
    return refs


async def _started(reader: Reader, policy: LookaheadPolicy, nursery: trio.Nursery) -> Lookahead:
    lookahead = attach_lookahead(reader, policy)
    assert lookahead is not None
    await nursery.start(lookahead.run)
    with trio.fail_after(10):
        while not reader.fills_ready:  # the shard layout, built in a thread
            await trio.sleep(0.005)
    return lookahead


async def _read(reader: Reader, ref: tuple[int, int, int]) -> bytes:
    shard, offset, size = ref
    return bytes(await reader.read(shard, offset, size, 0, size))


async def _read_all_of_one_shard(reader: Reader, lookahead: Lookahead, catalog: Catalog,
                                 inodes: dict[bytes, int], shard: int, data: bytes) -> Stream:
    """Announce every file of a shard, to the epoch's end, read each (checked against the
    shard's bytes), and wait for its fill to end; the stream is returned open."""
    refs = _refs(catalog, inodes, shard)
    stream = lookahead.open_stream()
    stream.announce(refs)
    stream.announced_all()
    for ref in refs:
        assert await _read(reader, ref) == data[ref[1] : ref[1] + ref[2]]
    with trio.fail_after(10):
        while shard in reader.fetches:
            await trio.sleep(0.005)
    return stream


def test_announced_members_fill_the_shard_byte_for_byte(tmp_path: Path,
                                                        shards: Shards) -> None:
    """Every read right and served from the members the fill's GETs landed, every byte of
    the shard fetched exactly once (the members' GETs with their headers, the end after the
    last announcement), the first GETs in read order, and the shard committed with its
    sha256 checked from the part file."""
    sources = _Sources()
    shard = 3
    policy = LookaheadPolicy(fill_requests=4)

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        catalog.sha256[shard] = hashlib.sha256(shards.paths[shard].read_bytes()).hexdigest()
        inodes = file_inodes(catalog)
        async with trio.open_nursery() as nursery:
            lookahead = await _started(reader, policy, nursery)
            refs = _refs(catalog, inodes, shard)
            stream = lookahead.open_stream()
            assert stream.announce(refs) == (len(refs), 0)
            for ref in refs:
                assert await _read(reader, ref) == shards.paths[shard].read_bytes()[
                    ref[1] : ref[1] + ref[2]]
            assert shard in reader.fetches and reader.fetches[shard].fill
            assert not cache.has(catalog.keys[shard])  # its end is not asked for yet
            stream.announced_all()
            with trio.fail_after(10):
                while shard in reader.fetches:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
        stats, la = reader.stats, lookahead.stats
        assert cache.has(catalog.keys[shard]) and stats.fills_done == 1, stats
        with open(cache.shards_dir / catalog.keys[shard], "rb") as f:
            assert f.read() == shards.paths[shard].read_bytes()
        size = catalog.shards[shard].size
        asked = sorted(a[1:] for a in sources.asked if a[0] == shards.urls[shard])
        assert asked[0][0] == 0 and asked[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(asked)), asked
        assert stats.shard_bytes == size and stats.shard_fetches_started == 0
        assert stats.member_fetches == 0 and la.requests == 0, (stats, la)
        assert la.part_entries == len(refs) and la.hole_requests >= 1, la
        assert la.hits == len(refs), la  # each read took its landed member
        # The epoch's first reads, one member per GET (with its header), asked first: the
        # first four GETs in flight are the first four announced (trio starts a batch of
        # tasks in no fixed order).
        first = [a[1:] for a in sources.asked if a[0] == shards.urls[shard]][:4]
        mine = sorted((lo, hi) for lo, hi in first
                      for _, offset, n in refs[:4] if lo <= offset and offset + n <= hi)
        assert mine == sorted(first), (first, refs[:4])
        assert all(hi - lo <= 1024 + n for (lo, hi), (_, _, n) in
                   zip(sorted(first), sorted(refs[:4], key=lambda r: r[1]), strict=True))

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=sources)


def test_a_failed_fill_get_reads_the_members_instead(tmp_path: Path, shards: Shards) -> None:
    """A fill's GET fails (the source's retries spent): the fill is dropped, nothing is
    cached from it, and its reads, the one waiting on that GET included, read their members
    by themselves: every read right, none an EIO."""
    sources = _Sources(fail=1)
    shard = 5

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        inodes = file_inodes(catalog)
        async with trio.open_nursery() as nursery:
            policy = LookaheadPolicy(fill_requests=2)
            lookahead = await _started(reader, policy, nursery)
            refs = _refs(catalog, inodes, shard)
            lookahead.open_stream().announce(refs)
            for ref in refs:
                assert await _read(reader, ref) == shards.paths[shard].read_bytes()[
                    ref[1] : ref[1] + ref[2]]
            nursery.cancel_scope.cancel()
        stats = reader.stats
        assert stats.fills_started == 1 and stats.fills_done == 0, stats
        assert stats.fetch_errors == 1 and stats.eio == 0, stats
        assert shard in reader.failed and lookahead.stats.part_errors >= 1
        assert stats.member_fetches + stats.shard_fetches_started >= 1, stats

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=sources)


def test_a_filled_shard_whose_digest_differs_is_not_cached(tmp_path: Path,
                                                           shards: Shards) -> None:
    sources = _Sources()
    shard = 6

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        catalog.sha256[shard] = hashlib.sha256(b"some other shard").hexdigest()
        inodes = file_inodes(catalog)
        async with trio.open_nursery() as nursery:
            lookahead = await _started(reader, LookaheadPolicy(), nursery)
            stream = lookahead.open_stream()
            refs = _refs(catalog, inodes, shard)
            stream.announce(refs)
            stream.announced_all()
            assert await _read(reader, refs[0]) == shards.paths[shard].read_bytes()[
                refs[0][1] : refs[0][1] + refs[0][2]]
            with trio.fail_after(10):
                while shard in reader.fetches:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
        assert not cache.has(catalog.keys[shard])
        assert shard in reader.failed and reader.stats.fetch_errors == 1

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=sources)


def test_over_the_cache_nothing_goes_to_part_files(tmp_path: Path, shards: Shards) -> None:
    """The dataset larger than the cache: announced members are held in RAM as before."""
    sources = _Sources()
    shard = 2

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        inodes = file_inodes(catalog)
        async with trio.open_nursery() as nursery:
            lookahead = attach_lookahead(reader, LookaheadPolicy())
            assert lookahead is not None
            await nursery.start(lookahead.run)
            refs = _refs(catalog, inodes, shard)
            lookahead.open_stream().announce(refs)
            for ref in refs:
                assert await _read(reader, ref) == shards.paths[shard].read_bytes()[
                    ref[1] : ref[1] + ref[2]]
            nursery.cancel_scope.cancel()
        assert reader.stats.fills_started == 0
        assert lookahead.stats.hits == len(refs) and lookahead.stats.part_entries == 0

    run_reader(tmp_path, shards.urls, 2 * shards.shard_size, body, sources=sources)


def test_a_fill_is_paced_by_the_buffer(tmp_path: Path, shards: Shards) -> None:
    """The fill's GETs land their members in RAM until read: with a buffer of three members'
    worth, no more is fetched ahead than that, and the reads (in the announced order) still
    find every member, the shard committed at the end."""
    sources = _Sources()
    shard = 4

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        inodes = file_inodes(catalog)
        refs = _refs(catalog, inodes, shard)
        buffer = 3 * max(n for _, _, n in refs)
        async with trio.open_nursery() as nursery:
            policy = LookaheadPolicy(fill_requests=8, buffer_bytes=buffer)
            lookahead = await _started(reader, policy, nursery)
            stream = lookahead.open_stream()
            stream.announce(refs)
            stream.announced_all()
            for ref in refs:
                await trio.sleep(0.01)  # the GETs run ahead as far as the buffer lets them
                assert lookahead.stats.buffered_bytes <= buffer, lookahead.stats
                assert await _read(reader, ref) == shards.paths[shard].read_bytes()[
                    ref[1] : ref[1] + ref[2]]
            with trio.fail_after(10):
                while shard in reader.fetches:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
        la = lookahead.stats
        assert la.peak_buffered_bytes <= buffer, la
        # Each read took its landed member, but those the shard's commit overtook (read from
        # the cache then: their held bytes let go at once, nothing left in the buffer).
        assert la.part_entries == len(refs) and 0 < la.hits <= len(refs), la
        assert la.buffered_bytes == 0, la
        assert cache.has(catalog.keys[shard]) and reader.stats.fills_done == 1

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=sources)


def test_reads_that_do_not_follow_the_announcements_are_still_right(tmp_path: Path,
                                                                    shards: Shards) -> None:
    """Announcements that do not match the reads cost bytes, never correctness: half of a
    shard's files announced (in one order), all of them read in another, files never
    announced included; every read right, none an EIO, and the shard still completes."""
    sources = _Sources()
    shard = 7

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        inodes = file_inodes(catalog)
        refs = _refs(catalog, inodes, shard)
        async with trio.open_nursery() as nursery:
            lookahead = await _started(reader, LookaheadPolicy(fill_requests=4), nursery)
            stream = lookahead.open_stream()
            stream.announce(refs[: len(refs) // 2])
            stream.announced_all()
            for ref in reversed(refs):
                assert await _read(reader, ref) == shards.paths[shard].read_bytes()[
                    ref[1] : ref[1] + ref[2]]
            with trio.fail_after(10):
                while shard in reader.fetches:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
        assert reader.stats.eio == 0, reader.stats
        assert cache.has(catalog.keys[shard])
        assert lookahead.stats.misses > 0, lookahead.stats  # the unannounced half

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=sources)


@pytest.mark.parametrize("case", ["crc32c", "wrong-crc32c", "buffered"])
def test_a_fill_is_checked_from_its_gets_crc32cs(tmp_path: Path, shards: Shards, case: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard the index gives a CRC-32C is checked from its fill GETs' own CRC-32Cs, no
    read back of the part file (read/fillwrites.py): committed byte for byte when it
    matches, its member GETs' bytes written past the page cache where the cache's file
    system allows; dropped (and not fetched again) when it does not match. With
    SHARDFS_FILL_BUFFERED=1 the bytes go through the page cache, checked the same way."""
    if case == "buffered":
        monkeypatch.setenv("SHARDFS_FILL_BUFFERED", "1")
    shard = 2
    data = shards.paths[shard].read_bytes()
    crc = f"{crc32c.crc32c(data):08x}" if case != "wrong-crc32c" else "0badc0de"

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        catalog.crc32c = [None] * len(catalog.shards)
        catalog.crc32c[shard] = crc
        catalog.sha256[shard] = None  # the CRC-32C is what is checked
        inodes = file_inodes(catalog)
        async with trio.open_nursery() as nursery:
            lookahead = await _started(reader, LookaheadPolicy(fill_requests=4), nursery)
            await _read_all_of_one_shard(reader, lookahead, catalog, inodes, shard, data)
            nursery.cancel_scope.cancel()
        stats = reader.stats
        probe = cache.root / "probe"
        fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            direct_here = case != "buffered" and dio_alignment(fd) is not None
        finally:
            os.close(fd)
            probe.unlink()
        assert (stats.fill_direct_bytes > 0.9 * len(data)) == direct_here, stats
        assert stats.fills_checked_from_gets == 1, stats
        if case == "wrong-crc32c":
            assert not cache.has(catalog.keys[shard]) and shard in reader.failed
            assert stats.fills_done == 0 and stats.fetch_errors == 1, stats
            return
        assert stats.fills_done == 1 and cache.has(catalog.keys[shard]), stats
        assert (cache.shards_dir / catalog.keys[shard]).read_bytes() == data

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=_Sources())


def test_members_landed_before_a_direct_fill_commits_are_read_from_where_they_landed(
        tmp_path: Path, shards: Shards) -> None:
    """A fill written past the page cache commits with members landed but not read yet:
    they stay where they landed and their reads are served from there (a read of the cache
    file would go to the disk), not from the cache file; each once."""
    shard = 4
    data = shards.paths[shard].read_bytes()

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        inodes = file_inodes(catalog)
        async with trio.open_nursery() as nursery:
            # a buffer that holds the whole shard: every member lands before any read
            policy = LookaheadPolicy(fill_requests=4, buffer_bytes=4 * len(data))
            lookahead = await _started(reader, policy, nursery)
            refs = _refs(catalog, inodes, shard)
            stream = lookahead.open_stream()
            stream.announce(refs)
            stream.announced_all()
            with trio.fail_after(10):
                while shard in reader.fetches or not cache.has(catalog.keys[shard]):
                    await trio.sleep(0.005)
            if not reader.stats.fill_direct_bytes:
                pytest.skip("no direct I/O in the cache dir's file system")
            for ref in refs:
                assert await _read(reader, ref) == data[ref[1] : ref[1] + ref[2]]
            nursery.cancel_scope.cancel()
        assert reader.stats.cache_hits == 0, reader.stats
        assert lookahead.stats.hits == len(refs) and lookahead.stats.buffered_bytes == 0, \
            lookahead.stats

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=_Sources())


def test_direct_writes_the_file_system_refuses_fail_one_fill_and_stop(
        tmp_path: Path, shards: Shards, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system whose O_DIRECT writes fail with EINVAL although it gave an alignment
    (injected: every direct write fails so): that fill fails and its reads read their
    members, every read right; the next fill writes through the page cache and is
    committed. (The failed shard's later fate is the reader's usual path: not asserted.)"""

    def refused(self: directwrite.Staged, direct_fd: int, fd: int) -> None:
        raise OSError(errno.EINVAL, "injected: the file system refuses this O_DIRECT write")

    monkeypatch.setattr(directwrite.Staged, "write", refused)
    first, second = 1, 7

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        inodes = file_inodes(catalog)
        async with trio.open_nursery() as nursery:
            lookahead = await _started(reader, LookaheadPolicy(fill_requests=4), nursery)
            for shard in (first, second):
                data = shards.paths[shard].read_bytes()
                stream = await _read_all_of_one_shard(reader, lookahead, catalog, inodes,
                                                      shard, data)
                stream.close()
            nursery.cancel_scope.cancel()
        if reader.stats.fills_started == reader.stats.fills_done == 2:
            pytest.skip("no direct I/O in the cache dir's file system")
        assert reader.stats.fetch_errors == 1, reader.stats  # the first fill's
        assert cache.has(catalog.keys[second]) and reader.stats.fills_done == 1, reader.stats
        assert (cache.shards_dir / catalog.keys[second]).read_bytes() == \
            shards.paths[second].read_bytes()
        assert reader.stats.eio == 0 and reader.stats.fill_direct_bytes == 0, reader.stats

    run_reader(tmp_path, shards.urls, 100 * shards.shard_size, body, sources=_Sources())


def test_a_fill_goes_on_while_the_cache_disk_takes_no_writes(
        shards: Shards, loop_disks: Callable[[str], LoopDisk]) -> None:
    """The cache's disk stops taking writes (an ext4 on a loop device frozen by fsfreeze;
    this VM's disk stalled for up to 1.3 s, docs/benchmarks-notes.md "Fill GETs that do not
    wait for the disk"): a fill's GETs hand their direct writes to the writer and end, so
    the fill's next GETs go out in turn and every announced member lands while nothing
    reaches the disk (GETs that waited for their writes would hold the fill's two slots
    till the disk came back, and each read would have to ask for its own member). The
    reads take the landed members; the fill commits after the thaw, byte for byte."""
    disk = loop_disks("cache")
    shard = 3
    data = shards.paths[shard].read_bytes()
    sources = _Sources()
    frozen = threading.Event()

    def thaw() -> None:
        if frozen.is_set():
            subprocess.run(["fsfreeze", "--unfreeze", str(disk.path)], capture_output=True)
            frozen.clear()

    async def body(reader: Reader, catalog: Catalog, cache: ShardCache) -> None:
        inodes = file_inodes(catalog)
        sources.gate = trio.Event()
        async with trio.open_nursery() as nursery:
            lookahead = await _started(reader, LookaheadPolicy(fill_requests=2), nursery)
            refs = _refs(catalog, inodes, shard)
            stream = lookahead.open_stream()
            stream.announce(refs)
            with trio.fail_after(10):  # the fill planned, its part file open, 2 GETs waiting
                while len(sources.asked) < 2:
                    await trio.sleep(0.005)
            fetch = reader.fetches[shard]
            assert fetch.fill and fetch.writes is not None, fetch
            if fetch.writes.direct_fd is None:
                pytest.skip("no direct I/O on the loop disk's file system")
            done = subprocess.run(["fsfreeze", "--freeze", str(disk.path)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"fsfreeze: {done.stderr.strip()}")
            frozen.set()
            # A loop blocked on the frozen disk could not time itself out: thawed from here.
            watchdog = threading.Timer(30, thaw)
            watchdog.start()
            try:
                sources.gate.set()
                with trio.fail_after(20):  # no read yet: each member's GET, in turn, ended
                    while lookahead.stats.part_requests < len(refs):
                        await trio.sleep(0.005)
                assert len(sources.asked) == len(refs), sources.asked
                for ref in refs:
                    assert await _read(reader, ref) == data[ref[1] : ref[1] + ref[2]]
                assert frozen.is_set(), "the fill went on only once the disk was back"
                stats = reader.stats
                assert stats.fill_direct_bytes == 0 and not cache.has(catalog.keys[shard]), \
                    stats
                assert lookahead.stats.hits == len(refs) and stats.member_fetches == 0, \
                    (lookahead.stats, stats)
            finally:
                watchdog.cancel()
                thaw()
            stream.announced_all()  # the fill's holes, then its commit
            with trio.fail_after(20):
                while shard in reader.fetches:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
        stats = reader.stats
        assert stats.fills_done == 1 and stats.fill_direct_bytes > 0, stats
        assert stats.eio == 0 and stats.fetch_errors == 0, stats
        assert (cache.shards_dir / catalog.keys[shard]).read_bytes() == data

    try:
        run_reader(disk.path, shards.urls, 100 * shards.shard_size, body, sources=sources)
    finally:
        thaw()
