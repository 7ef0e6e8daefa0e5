"""Whole-shard checksums (util/checksum.py): the CRC-32C an index records and a fetch checks,
and which of an index's digests a fetch is checked against."""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import os
import random
import tarfile
from pathlib import Path

import crc32c
import pytest
import trio

from shardfs.cache.partrecord import BLOCK, PrefixCrcs, block_crc
from shardfs.catalog.catalog import scan_local_file, scan_stream
from shardfs.catalog.shardindex import IndexFormatError, ShardIndex, decode_index, encode_index
from shardfs.pack import pack
from shardfs.sources import SourceSettings
from shardfs.sources.file import FileSource
from shardfs.util import checksum
from shardfs.util.checksum import (
    Crc32c,
    ShardSums,
    crc32c_combine,
    crc32c_of_blocks,
    crc32c_of_runs,
    digest_of_file,
    shard_check,
)
from shardfs.util.fileio import VIEW_BYTES, file_views


def crc_hex(data: bytes) -> str:
    return f"{crc32c.crc32c(data):08x}"


def test_crc32c_of_the_standard_check_string() -> None:
    digest = Crc32c()
    digest.update(b"123456789")
    assert digest.hexdigest() == "e3069283"  # CRC-32C's published check value


def test_crc32c_fed_in_pieces_of_every_kind_equals_the_whole() -> None:
    data = os.urandom(5 << 20)
    digest = Crc32c()
    pieces = [data[:100], memoryview(data)[100:70_000], data[70_000:(3 << 20)],
              bytearray(data[(3 << 20):(3 << 20) + 1]), data[(3 << 20) + 1:]]
    for piece in pieces:
        digest.update(piece)
    assert digest.hexdigest() == crc_hex(data)
    assert Crc32c().hexdigest() == "00000000"


def test_crc32c_hands_the_library_only_pieces_that_release_the_gil(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The crc32c package keeps the GIL for pieces under 32 KiB: small pieces are joined
    first, so a hashing thread never holds the GIL through a batch of them (only the last,
    short remainder at hexdigest may be smaller); larger ones (a memoryview too) go as they
    are, after their head has topped up what is pending before them to 32 KiB."""
    sizes: list[int] = []

    class Recording:
        @staticmethod
        def crc32c(data: bytes, value: int = 0) -> int:
            sizes.append(len(data))
            return crc32c.crc32c(data, value)

    monkeypatch.setattr(checksum, "_crc32c", Recording)
    data = os.urandom(1 << 20)
    digest = Crc32c()
    for pos in range(0, len(data) - 1000, 4096):
        digest.update(data[pos:min(pos + 4096, len(data) - 1000)])
    digest.update(memoryview(data)[len(data) - 1000:])
    big = os.urandom(100_000)
    digest.update(memoryview(big))
    assert digest.hexdigest() == crc_hex(data + big)
    assert all(size >= 32 << 10 for size in sizes), sizes
    assert sum(sizes) == len(data) + len(big)
    # A large piece after small ones tops them up from its head: the rest goes uncopied.
    assert sizes[-2:] == [32 << 10, len(data) + len(big) - sum(sizes[:-1])], sizes


def test_file_views_give_a_files_bytes_in_reused_pieces(tmp_path: Path) -> None:
    """file_views (what checks read back from the page cache) gives exactly the range, in
    views of one buffer per thread; a digest and a block CRC fed from them equal the whole's;
    a file that ends early is an OSError, not a short check."""
    data = os.urandom(3 * VIEW_BYTES + 12_345)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        views = []
        for view in file_views(fd, 777, len(data) - 1000):
            assert len(view) <= VIEW_BYTES
            views.append(bytes(view))
        assert b"".join(views) == data[777:-223]
        first = next(file_views(fd, 0, 10))
        second = next(file_views(fd, 5, 10))
        assert first.obj is second.obj  # the same buffer: no fresh memory per piece
        check = shard_check(None, crc_hex(data))
        assert check is not None and check.matches(digest_of_file(check, fd, len(data)))
        assert block_crc(fd, 0, len(data)) == crc32c.crc32c(data)
        with pytest.raises(OSError):
            list(file_views(fd, len(data) - 10, 20))
    finally:
        os.close(fd)


def test_shard_sums_are_sha256_and_crc32c() -> None:
    data = os.urandom(300_000)
    sums = ShardSums()
    sums.update(data[:1000])
    sums.update(data[1000:])
    assert sums.hexdigests() == (hashlib.sha256(data).hexdigest(), crc_hex(data))


def test_which_digest_a_fetch_is_checked_against() -> None:
    sha, crc = "ab" * 32, "0123abcd"
    assert checksum.FAST_CRC32C  # the C implementation is installed (a wheel for this CPU)
    assert shard_check(sha, crc) == checksum.ShardCheck("crc32c", crc)
    assert shard_check(sha, crc, "sha256") == checksum.ShardCheck("sha256", sha)
    assert shard_check(sha, None) == checksum.ShardCheck("sha256", sha)
    assert shard_check(None, crc, "sha256") == checksum.ShardCheck("crc32c", crc)
    assert shard_check(None, None) is None
    with pytest.raises(ValueError, match="verify must be one of"):
        shard_check(sha, crc, "md5")


def test_without_the_c_implementation_sha256_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "FAST_CRC32C", False)
    assert shard_check("ab" * 32, "0123abcd").kind == "sha256"
    assert shard_check(None, "0123abcd").kind == "crc32c"


def test_digest_of_a_file(tmp_path: Path) -> None:
    data = os.urandom((9 << 20) + 17)
    path = tmp_path / "part"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for kind, want in (("crc32c", crc_hex(data)), ("sha256", hashlib.sha256(data).hexdigest())):
            check = checksum.ShardCheck(kind, want)
            assert check.matches(digest_of_file(check, fd, len(data)))
        with pytest.raises(OSError, match="ends at"):
            digest_of_file(checksum.ShardCheck("crc32c", "0" * 8), fd, len(data) + 1)
    finally:
        os.close(fd)


def test_an_index_keeps_its_crc32c_and_refuses_a_malformed_one() -> None:
    index = ShardIndex(size=1024, sha256="cd" * 32, crc32c="89abcdef")
    back = decode_index(encode_index(index), expect_size=1024)
    assert (back.sha256, back.crc32c) == ("cd" * 32, "89abcdef")
    plain = encode_index(ShardIndex(size=1024, sha256="cd" * 32))
    assert b"crc32c" not in plain  # indexes without one are written as before
    assert decode_index(plain).crc32c is None
    bad = encode_index(index).replace(b'"89abcdef"', b'"89ABCDEF"')
    with pytest.raises(IndexFormatError, match="crc32c"):
        decode_index(bad)


def test_pack_records_both_digests_of_each_shard(tmp_path: Path) -> None:
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"{i}.jpg").write_bytes(os.urandom(3000 + i))
    result = pack(tmp_path / "src", tmp_path / "out", prefix="t", samples_per_shard=4)
    assert len(result.shards) == 2
    for record in result.shards:
        data = record.path.read_bytes()
        index = decode_index(Path(f"{record.path}.shardfs.idx").read_bytes())
        assert (record.crc32c, index.crc32c) == (crc_hex(data), crc_hex(data))
        assert index.sha256 == hashlib.sha256(data).hexdigest()


def test_a_compressed_local_shard_is_indexed_with_both_digests(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("a/b.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    path = tmp_path / "s.tar.gz"
    path.write_bytes(gzip.compress(raw.getvalue()))
    index = scan_local_file(str(path))
    data = path.read_bytes()
    assert (index.sha256, index.crc32c) == (hashlib.sha256(data).hexdigest(), crc_hex(data))


def test_the_streaming_indexer_records_both_digests(tmp_path: Path) -> None:
    """What indexes a remote shard (no sidecar index): it sees every byte as it streams."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for i in range(40):
            info = tarfile.TarInfo(f"c/{i}.bin")
            data = os.urandom(30_000)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "s.tar"
    path.write_bytes(raw.getvalue())
    source = FileSource(SourceSettings(chunk_size=65536))  # pieces as HTTP brings them

    async def index() -> ShardIndex:
        info = await source.stat(path.as_uri())
        return await scan_stream(source, info, None, lambda n: None)

    got = trio.run(index)
    data = path.read_bytes()
    assert (got.sha256, got.crc32c) == (hashlib.sha256(data).hexdigest(), crc_hex(data))
    assert len(got.paths) == 40


def test_the_crc32c_of_blocks_from_their_own_crcs() -> None:
    block = 4096
    data = os.urandom(5 * block)
    crcs = [crc32c.crc32c(data[i:i + block]) for i in range(0, len(data), block)]
    for n in range(6):
        assert crc32c_of_blocks(crcs[:n], block) == crc32c.crc32c(data[:n * block])
    tail = Crc32c(crc32c_of_blocks(crcs[:3], block))  # goes on from three blocks
    tail.update(data[3 * block:])
    assert tail.hexdigest() == crc_hex(data)


def test_the_crc32c_of_pieces_that_came_out_of_order() -> None:
    """crc32c_combine and crc32c_of_runs (a fill's GETs, read/fillwrites.py) against the
    package's CRC of the bytes whole; runs that leave a gap or overlap give None."""
    data = os.urandom(3 * 65536 + 777)
    rng = random.Random(5)
    for cut in [0, 1, 511, 512, 65536, len(data) - 1, len(data)] + \
            [rng.randrange(len(data)) for _ in range(20)]:
        assert crc32c_combine(crc32c.crc32c(data[:cut]), crc32c.crc32c(data[cut:]),
                              len(data) - cut) == crc32c.crc32c(data)
    cuts = [0, *sorted(rng.sample(range(1, len(data)), 40)), len(data)]
    runs = [(a, b, crc32c.crc32c(data[a:b])) for a, b in itertools.pairwise(cuts)]
    rng.shuffle(runs)
    assert crc32c_of_runs(runs, len(data)) == crc32c.crc32c(data)
    assert crc32c_of_runs(runs[1:], len(data)) is None  # a gap
    a, b, _ = runs[0]
    assert crc32c_of_runs([*runs, (a, b, crc32c.crc32c(data[a:b]))], len(data)) is None
    assert crc32c_of_runs([], 0) == 0 and crc32c_of_runs([], 1) is None


def test_a_fetchs_block_crcs_give_the_whole_shards_crc32c() -> None:
    """PrefixCrcs (the resume record's CRCs as bytes stream) gives the whole shard's CRC-32C,
    which the index's is checked against with no pass of its own: from byte 0, from a block
    a continued fetch starts at (the record's CRCs before it), and not where a block's CRC
    before the last is unknown or the entries are zlib's."""
    size = 2 * BLOCK + 5000
    data = os.urandom(size)
    blocks = [crc32c.crc32c(data[i:i + BLOCK]) for i in (0, BLOCK)]
    fresh = PrefixCrcs(0, size)
    for pos in range(0, size, 65536):
        fresh.update(data[pos:pos + 65536])
        assert fresh.whole() is None or pos + 65536 >= size
    assert fresh.take() == blocks and fresh.whole() == crc_hex(data)
    continued = PrefixCrcs(BLOCK, size, before=blocks[:1])
    continued.update(data[BLOCK:])
    assert continued.whole() == crc_hex(data)
    unknown = PrefixCrcs(BLOCK, size, before=[])
    unknown.update(data[BLOCK:])
    assert unknown.whole() is None
    zlib_entries = PrefixCrcs(0, size, "crc32")
    zlib_entries.update(data)
    assert zlib_entries.whole() is None
    exact = PrefixCrcs(0, 2 * BLOCK)  # the last block a whole one
    exact.update(data[:2 * BLOCK])
    assert exact.whole() == crc_hex(data[:2 * BLOCK]) and exact.take() == blocks[:1]
