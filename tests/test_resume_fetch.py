"""Whole-shard downloads in flight when a daemon ends continue from what is on disk (issue 25):
the part file and its record (cache/partrecord.py) are kept, the recorded blocks checked, and
only the rest is asked for, by a Range request. Real nginx behind the fault proxy (whose log
shows each GET's Range, and whose byte count shows what was sent); the reader driven alone
first, then a real mount whose daemon is SIGKILLed mid-download and taken over."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import subprocess
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import crc32c
import pytest
import trio

from shardfs.cache.partrecord import (
    BLOCK,
    HEAD,
    MAGIC,
    MAGIC_CRC32,
    PartRecord,
    PrefixCrcs,
    block_crcs,
)
from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.catalog import Catalog, open_catalog
from shardfs.catalog.shardindex import KIND_FILE
from shardfs.devtools.nginx import Nginx
from shardfs.read.reader import Reader
from shardfs.sources import Sources
from tests.conftest import SHARDFS, Mounter, needs_shim
from tests.faultproxy import FaultProxy
from tests.reliability import RandomDataset, make_dataset
from tests.test_sources import server_without_ranges
from tests.test_takeover import (
    Readers,
    kill_and_time,
    spare_ready,
    stats,
    wait_serving_again,
    wait_until,
)

STALL_AT = 3 * BLOCK  # the first daemon's GET stalls here: 3 blocks recorded


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> RandomDataset:
    """One shard of ~22 MiB (~100 files of ~250 KB) with its index (size, sha256)."""
    ds = make_dataset(tmp_path_factory.mktemp("resume"), files=100, mean_kb=180,
                      shard_kb=64 * 1024, seed=2511)
    assert len(ds.names) == 1 and ds.shards.shards[0].size > STALL_AT + 2 * BLOCK
    return ds


def publish_with_index(ds: RandomDataset, dest: Path) -> Path:
    """The shards and their `.shardfs.idx` files: the catalog knows each shard's sha256."""
    shutil.copytree(ds.shard_dir, dest, dirs_exist_ok=True)
    return dest


def shard_bytes(ds: RandomDataset) -> bytes:
    return (ds.shard_dir / ds.names[0]).read_bytes()


def range_starts(proxy: FaultProxy, ds: RandomDataset) -> list[int]:
    """Where each GET of the dataset's shard up to its end (a whole-shard fetch, not a member read:
    a tar ends in zero blocks, no member does) the proxy saw began."""
    name, size = ds.names[0], ds.shards.shards[0].size
    starts = []
    for req in proxy.requests:
        if req.method == "GET" and req.target.endswith(name) and "range" in req.headers:
            first, last = req.headers["range"].split("=")[1].split("-")
            if int(last) == size - 1:
                starts.append(int(first))
    return starts


def test_block_crcs_computed_as_bytes_stream_equal_those_read_back(tmp_path: Path):
    """A fetch records its blocks' CRCs from the bytes as they stream, in chunks that do not
    fall on block boundaries (PrefixCrcs); they must be what reading the blocks back from the
    file gives, so that the next daemon's check (verify_prefix) keeps them. From byte 0, and
    from a block boundary (a continued fetch); the last block (ending at the shard's end) is
    never given."""
    size = 3 * BLOCK + 12345
    data = os.urandom(size)
    path = tmp_path / "shard.part"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in (0, BLOCK):
            crcs = PrefixCrcs(start, size)
            pos, got = start, []
            for n in (1, 65536, BLOCK - 7, 3 * 65536 + 5, BLOCK):  # then the rest
                crcs.update(data[pos:pos + n])
                pos += n
                got += crcs.take()
            crcs.update(data[pos:])
            got += crcs.take()
            assert got == block_crcs(fd, start, 3 * BLOCK), start
        whole = PrefixCrcs(0, 2 * BLOCK)  # a shard of exactly 2 blocks: only the first
        whole.update(data[: 2 * BLOCK])
        assert whole.take() == [crc32c.crc32c(data[:BLOCK])]
        # Records of daemons before session 20 hold zlib's CRC-32s: continued with those.
        old = PrefixCrcs(BLOCK, size, "crc32")
        old.update(data[BLOCK:])
        assert old.take() == [zlib.crc32(data[i:i + BLOCK]) for i in (BLOCK, 2 * BLOCK)]
        assert old.take() == [] and old.whole() is None
        record = PartRecord.create(tmp_path / "shard.crc", size)
        crcs = PrefixCrcs(0, size)
        crcs.update(data)
        record.extend(crcs.take())
        assert record.verify_prefix(fd) == 3 * BLOCK
        record.close()
    finally:
        os.close(fd)


class _OddChunksThenStall:
    """An HTTP source whose whole-shard stream comes in 3,000-byte pieces (so batches of 4 MiB
    do not end on block boundaries) and stops, without ending, at byte `stop`."""

    def __init__(self, inner, stop: int) -> None:
        self.inner, self.stop = inner, stop
        self.stats = inner.stats

    async def stat(self, url: str):
        return await self.inner.stat(url)

    async def fetch_optional(self, url: str):
        return await self.inner.fetch_optional(url)

    async def stream(self, shard, start: int, end: int):
        whole = end == shard.size
        pos = start
        async with contextlib.aclosing(self.inner.stream(shard, start, end)) as chunks:
            async for chunk in chunks:
                for i in range(0, len(chunk), 3000):
                    piece = chunk[i:i + 3000]
                    if whole and pos + len(piece) > self.stop:
                        piece = piece[: self.stop - pos]
                        if piece:
                            yield piece
                        await trio.sleep_forever()
                    pos += len(piece)
                    yield piece

    async def aclose(self) -> None:
        await self.inner.aclose()


# -- the reader alone: an interrupted fetch, continued -----------------------------------------
Body = Callable[[Reader, Catalog], Awaitable[None]]


def run_reader(cache_dir: Path, url: str, body: Body, *, keep_partial: bool = False,
               sources: Sources | None = None) -> Reader:
    """A reader on the cache dir: body runs, then the reader is cancelled (as a daemon's
    exit; `keep_partial`: as one exiting for a new daemon, which leaves its part files)."""
    cache = ShardCache(cache_dir, 1 << 30)
    cache.open()
    box: list[Reader] = []

    async def main() -> None:
        nonlocal sources
        sources = sources or Sources()
        catalog = await open_catalog([url], sources, cache, warm=False)
        reader = Reader(catalog, cache, sources)
        box.append(reader)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)
            await body(reader, catalog)
            reader.keep_partial = keep_partial
            nursery.cancel_scope.cancel()
        await sources.aclose()

    try:
        trio.run(main)
    finally:
        cache.close()
    return box[0]


def test_a_block_is_recorded_when_the_prefix_passes_its_end(big, nginx: Nginx, tmp_path: Path):
    """The record takes a block's CRC as soon as the fetch's bytes pass the block's end, not
    only when the next 4 MiB batch is full: a GET stalled just past a block boundary leaves
    that block recorded (at most one block is fetched again after a kill)."""
    publish_with_index(big, nginx.root / "oddchunks")
    stop = 2 * BLOCK

    class OddSources(Sources):
        def for_url(self, url: str):
            return _OddChunksThenStall(super().for_url(url), stop)

    async def body(reader: Reader, catalog: Catalog) -> None:
        record = tmp_path / "cache" / "parts" / f"{catalog.keys[0]}.crc"
        shard, offset, size = min(members(catalog).values(), key=lambda m: m[1])
        await reader.read(shard, offset, size, 0, size)
        with trio.fail_after(20):
            while not record.exists() or record.stat().st_size < HEAD + 4 * 2:
                await trio.sleep(0.02)
        assert reader.fetches[0].arrived == stop
        data = shard_bytes(big)
        kept = record.read_bytes()[HEAD:]
        assert kept == b"".join(struct.pack("<I", crc32c.crc32c(data[i:i + BLOCK]))
                                for i in (0, BLOCK)), kept

    run_reader(tmp_path / "cache", f"{nginx.url}/oddchunks/{big.names[0]}", body,
               sources=OddSources())


def members(catalog: Catalog) -> dict[str, tuple[int, int, int]]:
    """path -> (shard, offset, size) of every file."""
    tree = catalog.tree
    out = {}
    for i in range(len(tree)):
        if tree.kind[i] == KIND_FILE:
            ref = tree.file_ref(i + 1)
            out[tree.path(i + 1).decode()] = (ref.shard, ref.offset, ref.size)
    return out


async def read_everything(reader: Reader, catalog: Catalog, ds: RandomDataset) -> None:
    """Every file, checked against its sha256, in the shard's order."""
    files = members(catalog)
    for path, (shard, offset, size) in sorted(files.items(), key=lambda kv: kv[1][1]):
        data = await reader.read(shard, offset, size, 0, size)
        assert hashlib.sha256(data).hexdigest() == ds.sha[path], path
    assert len(files) == len(ds.sha)
    with trio.fail_after(30):  # and the fetch bringing them is committed
        while reader.fetches:
            await trio.sleep(0.01)


async def start_and_stall(reader: Reader, catalog: Catalog, record: Path) -> None:
    """Start the shard's fetch (a read of its first file) and wait until its record holds
    the 3 blocks the proxy lets through before it stalls."""
    shard, offset, size = min(members(catalog).values(), key=lambda m: m[1])
    await reader.read(shard, offset, size, 0, size)
    with trio.fail_after(30):
        while not record.exists() or record.stat().st_size < HEAD + 4 * 3:
            await trio.sleep(0.02)
    assert reader.fetches and reader.stats.resumed_fetches == 0


def interrupted(ds: RandomDataset, nginx: Nginx, proxy: FaultProxy, cache_dir: Path) -> str:
    """A first reader's fetch of the shard, stalled after STALL_AT bytes and ended as for a
    takeover: its part file and record stay. Returns the shard's URL."""
    publish_with_index(ds, nginx.root / "resume")
    url = f"{proxy.url}/resume/{ds.names[0]}"
    key = {}

    async def body(reader: Reader, catalog: Catalog) -> None:
        key["k"] = catalog.keys[0]
        proxy.stall(60, after_bytes=STALL_AT)  # only a whole-shard GET gets that far
        await start_and_stall(reader, catalog, cache_dir / "parts" / f"{catalog.keys[0]}.crc")

    run_reader(cache_dir, url, body, keep_partial=True)
    proxy.clear()
    assert (cache_dir / "shards" / f"{key['k']}.part").exists()
    return url


def test_a_fetch_left_by_a_daemon_continues_from_its_record(big, nginx: Nginx, tmp_path: Path):
    """The next reader on the cache dir keeps the part, checks its 3 recorded blocks, asks
    only for the rest (Range from 12 MiB) and serves every file right; the cached shard is
    the source's, byte for byte."""
    with FaultProxy(nginx.port) as proxy:
        url = interrupted(big, nginx, proxy, tmp_path / "cache")
        proxy.reset_counters()
        size = big.shards.shards[0].size
        reader = run_reader(tmp_path / "cache", url,
                            lambda r, c: read_everything(r, c, big))
        s = reader.stats
        assert (s.resumed_fetches, s.resumed_bytes, s.resume_rejected_bytes) == (1, STALL_AT, 0)
        assert range_starts(proxy, big) == [STALL_AT]
        assert s.shard_bytes == size - STALL_AT and s.shard_fetches_done == 1
        assert s.member_bytes == 0 and s.eio == 0
        key = reader.catalog.keys[0]
    assert (tmp_path / "cache" / "shards" / key).read_bytes() == shard_bytes(big)
    assert not list((tmp_path / "cache" / "parts").iterdir())  # the record went with commit


def test_a_record_of_an_earlier_version_is_continued_with_its_crcs(big, nginx: Nginx,
                                                                    tmp_path: Path):
    """A part left by a daemon before session 20: its record starts `shardfs-part-1` and holds
    zlib's CRC-32s. The next daemon (an upgrade under `shardfs restart`) checks the blocks
    with those, asks only for the rest and commits the shard (checked against the index's
    CRC-32C by a pass of its own: the old CRCs cannot give it)."""
    with FaultProxy(nginx.port) as proxy:
        url = interrupted(big, nginx, proxy, tmp_path / "cache")
        (part,) = (tmp_path / "cache" / "shards").glob("*.part")
        (record,) = (tmp_path / "cache" / "parts").glob("*.crc")
        head = record.read_bytes()[:HEAD]
        assert head.startswith(MAGIC)
        with open(part, "rb") as f:
            old = [zlib.crc32(f.read(BLOCK)) for _ in range(STALL_AT // BLOCK)]
        record.write_bytes(MAGIC_CRC32 + head[len(MAGIC):]
                           + b"".join(struct.pack("<I", c) for c in old))
        assert PartRecord.load(record, big.shards.shards[0].size).kind == "crc32"
        proxy.reset_counters()
        reader = run_reader(tmp_path / "cache", url,
                            lambda r, c: read_everything(r, c, big))
        s = reader.stats
        assert (s.resumed_fetches, s.resumed_bytes, s.resume_rejected_bytes) == (1, STALL_AT, 0)
        assert range_starts(proxy, big) == [STALL_AT]
        assert s.shard_fetches_done == 1 and s.fetch_errors == 0 and s.eio == 0
        key = reader.catalog.keys[0]
    assert (tmp_path / "cache" / "shards" / key).read_bytes() == shard_bytes(big)


def test_a_part_with_wrong_bytes_is_continued_only_up_to_them(big, nginx: Nginx,
                                                              tmp_path: Path):
    """A byte of the part's second block changed (as a disk error would): its CRC fails, so
    only the first block is kept and the rest fetched; no file reads wrong."""
    with FaultProxy(nginx.port) as proxy:
        url = interrupted(big, nginx, proxy, tmp_path / "cache")
        (part,) = (tmp_path / "cache" / "shards").glob("*.part")
        with open(part, "r+b") as f:
            f.seek(BLOCK + 1234)
            old = f.read(1)
            f.seek(BLOCK + 1234)
            f.write(bytes([old[0] ^ 0xFF]))
        proxy.reset_counters()
        reader = run_reader(tmp_path / "cache", url, lambda r, c: read_everything(r, c, big))
        s = reader.stats
        assert (s.resumed_bytes, s.resume_rejected_bytes) == (BLOCK, 2 * BLOCK)
        assert range_starts(proxy, big) == [BLOCK]
        assert s.eio == 0
        key = reader.catalog.keys[0]
    assert (tmp_path / "cache" / "shards" / key).read_bytes() == shard_bytes(big)


def test_a_truncated_part_or_record_is_continued_from_what_checks_out(big, nginx: Nginx,
                                                                      tmp_path: Path):
    """A record cut in the middle of its third entry claims two blocks; a part file of
    another size than the shard's is not used at all (fetched from 0)."""
    with FaultProxy(nginx.port) as proxy:
        url = interrupted(big, nginx, proxy, tmp_path / "cache")
        (record,) = (tmp_path / "cache" / "parts").glob("*.crc")
        os.truncate(record, HEAD + 4 * 2 + 3)
        proxy.reset_counters()
        reader = run_reader(tmp_path / "cache", url, lambda r, c: read_everything(r, c, big))
        assert reader.stats.resumed_bytes == 2 * BLOCK
        assert range_starts(proxy, big) == [2 * BLOCK]

        cache2 = tmp_path / "cache2"
        url = interrupted(big, nginx, proxy, cache2)
        (part,) = (cache2 / "shards").glob("*.part")
        os.truncate(part, 5 * BLOCK)
        proxy.reset_counters()
        reader = run_reader(cache2, url, lambda r, c: read_everything(r, c, big))
        assert reader.stats.resumed_fetches == 0
        assert range_starts(proxy, big) == [0]


def test_a_continued_fetch_failing_its_check_is_fetched_again_from_0(big, nginx: Nginx,
                                                                     tmp_path: Path):
    """Bytes changed in the kept prefix *and* their CRC rewritten to match (no crash leaves
    that, a forger does): the blocks pass, the index's CRC-32C of the whole shard (computed
    from the blocks' CRCs, the forged one among them) does not, and the shard
    is fetched again from byte 0 instead of being cached wrong or marked as changed. (What
    such a forged prefix holds is served until that check, as a forged complete shard would
    be: the record guards against what a crash leaves, not against someone who can write
    the cache dir.)"""
    with FaultProxy(nginx.port) as proxy:
        url = interrupted(big, nginx, proxy, tmp_path / "cache")
        (part,) = (tmp_path / "cache" / "shards").glob("*.part")
        (record,) = (tmp_path / "cache" / "parts").glob("*.crc")
        with open(part, "r+b") as f:
            f.seek(100)
            f.write(b"forged")
            f.seek(0)
            crc = crc32c.crc32c(f.read(BLOCK))
        with open(record, "r+b") as f:
            f.seek(HEAD)
            f.write(struct.pack("<I", crc))
        proxy.reset_counters()

        async def body(reader: Reader, catalog: Catalog) -> None:
            with trio.fail_after(30):  # continued at start, fetched again, committed
                while not reader.cache.has(catalog.keys[0]):
                    await trio.sleep(0.02)
            await read_everything(reader, catalog, big)

        reader = run_reader(tmp_path / "cache", url, body)
        s = reader.stats
        assert s.resumed_fetches == 1 and s.resumed_bytes == STALL_AT
        assert range_starts(proxy, big) == [STALL_AT, 0]
        assert s.shard_fetches_done == 1 and s.fetch_errors == 0 and s.eio == 0
        key = reader.catalog.keys[0]
    assert (tmp_path / "cache" / "shards" / key).read_bytes() == shard_bytes(big)


def test_parts_not_of_this_mount_or_over_budget_are_deleted(big, nginx: Nginx,
                                                             tmp_path: Path):
    """A kept part is deleted, not continued, when its shard is not in the new mount (a
    remount of other shards on the same cache dir: its key is not in the catalog), or when
    the budget no longer holds it; a record whose part is gone is deleted too."""
    with FaultProxy(nginx.port) as proxy:
        interrupted(big, nginx, proxy, tmp_path / "cache")
        shutil.copy(nginx.root / "resume" / big.names[0], nginx.root / "resume" / "other.tar")
        shutil.copy(nginx.root / "resume" / f"{big.names[0]}.shardfs.idx",
                    nginx.root / "resume" / "other.tar.shardfs.idx")
        reader = run_reader(tmp_path / "cache", f"{proxy.url}/resume/other.tar",
                            lambda r, c: trio.sleep(0))
        assert reader.stats.resumed_fetches == 0 and reader.cache.kept == {}
        assert not list((tmp_path / "cache" / "shards").glob("*.part"))
        assert not list((tmp_path / "cache" / "parts").iterdir())

        interrupted(big, nginx, proxy, tmp_path / "cache2")
        cache = ShardCache(tmp_path / "cache2", big.shards.shards[0].size - 1)
        cache.open()
        try:
            assert cache.kept == {} and cache.used == 0
            assert not list((tmp_path / "cache2" / "shards").glob("*.part"))
        finally:
            cache.close()

        interrupted(big, nginx, proxy, tmp_path / "cache3")
        (part,) = (tmp_path / "cache3" / "shards").glob("*.part")
        part.unlink()
        cache = ShardCache(tmp_path / "cache3", 1 << 30)
        cache.open()
        try:
            assert cache.kept == {} and not list((tmp_path / "cache3" / "parts").iterdir())
        finally:
            cache.close()


def test_a_shard_on_a_server_ignoring_range_starts_from_0(big, tmp_path: Path):
    """A server that answers Range with the whole file (200): the shard is read only whole,
    its fetch keeps no record, and a part it leaves is deleted by the next start."""
    root = publish_with_index(big, tmp_path / "www")
    with server_without_ranges(root) as base:
        url = f"{base}/{big.names[0]}"

        async def start(reader: Reader, catalog: Catalog) -> None:
            assert reader.whole_only[0]
            shard, offset, size = min(members(catalog).values(), key=lambda m: m[1])
            await reader.read(shard, offset, size, 0, size)
            assert reader.fetches or reader.cache.has(catalog.keys[0])

        run_reader(tmp_path / "cache", url, start, keep_partial=True)
        assert not list((tmp_path / "cache" / "parts").iterdir())
        reader = run_reader(tmp_path / "cache", url, lambda r, c: read_everything(r, c, big))
        assert reader.stats.resumed_fetches == 0 and reader.stats.eio == 0


# -- a real mount: kill -9 of the daemon mid-download, a spare takes over ---------------------
@needs_shim
@pytest.mark.parametrize("how,workers", [("kill-9", "2"), ("restart", "1")])
def test_a_daemon_ending_mid_download_leaves_it_to_the_next(big, nginx: Nginx,
                                                            mounter: Mounter, how: str,
                                                            workers: str):
    """8 reader processes (every file, sha256-checked) while the daemon downloads the one
    ~22 MiB shard; the GET stalls after 12 MiB and the daemon (with 2 FUSE workers, or
    alone) is SIGKILLed (or `shardfs restart` replaces it). The daemon that takes over
    continues the download from 12 MiB: 0 read errors, 0 wrong bytes, and what the proxy
    sends after the kill is the rest of the shard (plus the few members readers may read
    early), not the whole shard again."""
    publish_with_index(big, nginx.root / "resume")
    size = big.shards.shards[0].size
    with FaultProxy(nginx.port) as proxy:
        m = mounter.mount([f"{proxy.url}/resume/{big.names[0]}"], None, None, "--no-warm",
                          "--workers", workers)
        spare_ready(m)
        proxy.stall(120, after_bytes=STALL_AT)  # only whole-shard GETs get that far
        readers = Readers(m.mountpoint, big.sha, seed=7)
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size >= HEAD + 4 * 3
                      for p in (m.cache_dir / "parts").glob("*.crc")):
            assert time.monotonic() < deadline, "the download never reached the stall"
            time.sleep(0.05)
        before = stats(m.mountpoint)["reader"]
        proxy.clear()  # the next daemon's GET goes through
        proxy.reset_counters()
        if how == "kill-9":
            old, gap = kill_and_time(m.mountpoint, m.mountpoint / min(big.sha))
            assert gap < 5, gap
            wait_serving_again(m.mountpoint, old)
        else:
            result = subprocess.run([*SHARDFS, "restart", str(m.mountpoint)],
                                    capture_output=True, text=True, timeout=180)
            assert result.returncode == 0, result.stderr
        readers.check(len(big.sha))
        wait_until(lambda: stats(m.mountpoint)["reader"]["shard_fetches_done"] == 1,
                   "the continued download to complete")
        after = stats(m.mountpoint)
        r = after["reader"]
        assert after["takeovers"] == 1
        assert before["shard_fetches_done"] == 0
        assert r["resumed_fetches"] == 1 and r["resumed_bytes"] == STALL_AT, r
        assert r["resume_rejected_bytes"] == 0 and r["eio"] == 0, r
        assert r["shard_bytes"] == size - STALL_AT and r["shard_fetches_done"] == 1, r
        assert range_starts(proxy, big) == [STALL_AT]
        shown = subprocess.run([*SHARDFS, "stats", str(m.mountpoint)], capture_output=True,
                               text=True, timeout=60).stdout
        assert "continued       1 download(s) an earlier daemon left: 12.0 MiB kept" in shown, \
            shown
        # The proxy sent the rest of the shard and the members read early (the old daemon's
        # last ones may still have been under way), not the shard again.
        sent = proxy.body_bytes
        assert size - STALL_AT <= sent <= size - STALL_AT + r["member_bytes"] + BLOCK, \
            (sent, size, r)
