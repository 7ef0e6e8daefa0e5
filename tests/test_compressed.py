"""Compressed shards (.tar.gz, .tgz, .tar.zst, .tar.lz4): decompressed into the cache whole."""

from __future__ import annotations

import gzip
import io
import os
import shutil
from pathlib import Path

import pytest

from shardfs.catalog.codecs import CodecError, codec_for, decompressor
from tests.conftest import Dataset, Mounter

zstandard = pytest.importorskip("zstandard")
lz4_frame = pytest.importorskip("lz4.frame")

COMPRESS = {
    ".tar.gz": gzip.compress,
    ".tgz": lambda data: gzip.compress(data[:1000]) + gzip.compress(data[1000:]),  # 2 members
    ".tar.zst": lambda data: zstandard.ZstdCompressor().compress(data),
    ".tar.lz4": lambda data: lz4_frame.compress(data),
}


def compressed_copies(ds: Dataset, dest: Path, suffix: str) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for i, shard in enumerate(ds.shards.shards):
        name = f"c-{i:06d}{suffix}"
        (dest / name).write_bytes(COMPRESS[suffix](shard.path.read_bytes()))
        names.append(name)
    return names


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_codec_round_trip_and_truncation(suffix: str):
    data = os.urandom(200_000) + bytes(300_000)
    blob = COMPRESS[suffix](data)
    codec = codec_for(f"http://x/a{suffix}?v=1")
    assert codec is not None
    d = decompressor(codec)
    out = b"".join(d.feed(blob[i : i + 4096]) for i in range(0, len(blob), 4096))
    assert out + d.finish() == data
    cut = decompressor(codec)
    cut.feed(blob[: len(blob) // 2])
    with pytest.raises(CodecError, match="truncated"):
        cut.finish()
    with pytest.raises(CodecError, match="corrupt"):
        decompressor(codec).feed(b"this is not compressed at all" * 10)


def lz4_legacy(data: bytes) -> bytes:
    """The lz4 legacy format (`lz4 -l`): magic, then (size, block) pairs of <= 8 MiB."""
    import lz4.block

    out = bytearray(b"\x02\x21\x4c\x18")
    for i in range(0, len(data), 8 << 20):
        block = lz4.block.compress(data[i : i + (8 << 20)], store_size=False)
        out += len(block).to_bytes(4, "little") + block
    return bytes(out)


@pytest.mark.parametrize("chunk", [1, 3, 4096, 1 << 20])
def test_lz4_legacy_frames(chunk: int) -> None:
    data = os.urandom(100_000) + bytes(9 << 20)  # two legacy blocks
    blob = lz4_legacy(data) + lz4_frame.compress(b"then a modern frame")
    d = decompressor("lz4")
    out = b"".join(d.feed(blob[i : i + chunk]) for i in range(0, len(blob), chunk))
    assert out + d.finish() == data + b"then a modern frame"
    cut = decompressor("lz4")
    cut.feed(lz4_legacy(data)[:-10])  # a block cut short
    with pytest.raises(CodecError, match="truncated"):
        cut.finish()
    whole = decompressor("lz4")  # a legacy stream has no end mark: EOF after a block is fine
    assert whole.feed(lz4_legacy(b"abc")) + whole.finish() == b"abc"


@pytest.mark.parametrize("suffix", [".tar.gz", ".tar.lz4", ".tar.zst"])
@pytest.mark.parametrize("garbage", [b"junk data at the end of the file\n", bytes(1000), b"\x1f"])
def test_trailing_garbage_is_ignored_and_counted(suffix: str, garbage: bytes) -> None:
    """As gzip ("decompression OK, trailing garbage ignored"), GNU tar and libarchive."""
    data = os.urandom(5000)
    d = decompressor(codec_for("a" + suffix) or "")
    blob = COMPRESS[suffix](data) + garbage
    out = b"".join(d.feed(blob[i : i + 7]) for i in range(0, len(blob), 7))
    assert out + d.finish() == data
    assert d.trailing_garbage == len(garbage)


@pytest.mark.parametrize("suffix", [".tar.gz", ".tar.lz4", ".tar.zst"])
def test_output_comes_in_bounded_pieces(suffix: str) -> None:
    """A small input that decompresses to a lot (320 MiB of zeros) never sits in memory whole."""
    zeros = 160 << 20
    if suffix == ".tar.gz":  # deflate tops out near 1000:1: build the bomb from members
        blob = gzip.compress(bytes(zeros), compresslevel=9) * 2
    else:
        blob = COMPRESS[suffix](bytes(zeros)) * 2
    d = decompressor(codec_for("a" + suffix) or "")
    pieces: list[int] = []
    d.feed_into(blob, lambda piece: pieces.append(len(piece)))
    d.finish()
    assert sum(pieces) == 2 * zeros
    assert max(pieces) <= 128 << 20


@pytest.mark.parametrize("suffix", [".tar.gz", ".tar.zst", ".tar.lz4"])
def test_mount_compressed_shards_over_http(suffix, dataset: Dataset, nginx, mounter: Mounter):
    names = compressed_copies(dataset, nginx.root / "z", suffix)
    n = len(names)
    m = mounter.mount([f"{nginx.url}/z/c-{{000000..{n - 1:06d}}}{suffix}"], None, None,
                      "--no-warm")
    nginx.reset_log()
    for rel, data in dataset.files().items():
        assert (m.mountpoint / rel).read_bytes() == data
    stats = m.stats()
    # Whole compressed shards only: one body request per shard, no member reads.
    bodies = [r for r in nginx.access_log() if r.range != "bytes=0-0"]
    assert len(bodies) == n
    assert stats["reader"]["member_fetches"] == 0
    assert stats["dataset_bytes"] == sum(s.size for s in dataset.shards.shards)  # plain bytes


def test_mount_local_tgz_with_warm_indexing(dataset: Dataset, mounter: Mounter, tmp_path: Path,
                                            nginx):
    # Local: indexed by decompressing once; remote: indexing warms the cache.
    compressed_copies(dataset, tmp_path / "local", ".tgz")
    n = len(dataset.shards.shards)
    local = mounter.mount([str(tmp_path / "local" / f"c-{{000000..{n - 1:06d}}}.tgz")])
    for rel, data in dataset.files().items():
        assert (local.mountpoint / rel).read_bytes() == data
    shutil.copytree(tmp_path / "local", nginx.root / "tgz")
    remote = mounter.mount([f"{nginx.url}/tgz/c-{{000000..{n - 1:06d}}}.tgz"])
    nginx.reset_log()
    for rel, data in dataset.files().items():
        assert (remote.mountpoint / rel).read_bytes() == data
    assert nginx.access_log() == []  # everything was cached while indexing
    assert remote.stats()["shards_cached"] == n


def test_truncated_compressed_shard_is_rejected(tmp_path: Path, mounter: Mounter):
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("a.bin")
        info.size = 50_000
        tf.addfile(info, io.BytesIO(os.urandom(50_000)))
    blob = gzip.compress(buf.getvalue())
    (tmp_path / "cut.tar.gz").write_bytes(blob[: len(blob) // 2])
    mnt, cache = mounter.paths()
    result = mounter.run(str(tmp_path / "cut.tar.gz"), str(mnt), "--cache-dir", str(cache))
    assert result.returncode != 0 and "truncated" in result.stderr
    assert not os.path.ismount(mnt)


def test_cache_too_small_for_a_compressed_shard_gives_eio(dataset: Dataset, nginx,
                                                         mounter: Mounter):
    names = compressed_copies(dataset, nginx.root / "z", ".tar.gz")
    n = len(names)
    m = mounter.mount([f"{nginx.url}/z/c-{{000000..{n - 1:06d}}}.tar.gz"], None, None,
                      "--no-warm", "--cache-size", "1K")
    rel = next(iter(dataset.files()))
    with pytest.raises(OSError) as info:
        (m.mountpoint / rel).read_bytes()
    assert info.value.errno == 5
    assert "cannot hold this compressed shard" in m.log()


