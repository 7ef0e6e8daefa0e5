"""Sparse members: the logical-range mapping, their index and tree persistence, and reads
through the real reader (holes are zeros; data runs come from the shard)."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import tarfile
from array import array
from pathlib import Path

import pytest
import trio

from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.catalog import open_catalog
from shardfs.catalog.shardindex import (
    INDEX_FORMAT,
    INDEX_FORMAT_SPARSE,
    IndexFormatError,
    ShardIndex,
    decode_index,
    encode_index,
)
from shardfs.catalog.sparse import (
    HOLE,
    SparseMap,
    decode_map,
    encode_map,
    make_map,
    pieces,
    stored_size,
)
from shardfs.catalog.tar import Member
from shardfs.catalog.tree import Tree, build_tree
from shardfs.read.reader import Reader
from shardfs.read.sparse import read_sparse
from shardfs.sources import Sources


def expand(runs: list[int], size: int, stored: bytes) -> bytes:
    """Reference model: the logical file, built run by run."""
    out = bytearray(size)
    at = 0
    for start, length in zip(runs[0::2], runs[1::2], strict=True):
        out[start : start + length] = stored[at : at + length]
        at += length
    return bytes(out)

def read_model(runs: list[int], size: int, stored: bytes, off: int, length: int) -> bytes:
    out = bytearray()
    for at, n in pieces(SparseMap.of(runs), size, off, length):
        out += bytes(n) if at == HOLE else stored[at : at + n]
    return bytes(out)

def test_pieces_against_the_model() -> None:
    rng = random.Random(3)
    for _ in range(300):
        size = rng.randint(0, 5000)
        pairs, pos = [], 0
        while pos < size and rng.random() < 0.8:
            start = rng.randint(pos, size)
            length = rng.randint(0, size - start)
            pairs.append((start, length))
            pos = start + length
        runs = make_map(pairs, size)
        assert runs is not None
        stored = rng.randbytes(stored_size(runs))
        logical = expand(list(runs), size, stored)
        for _ in range(20):
            off, length = rng.randint(0, size + 10), rng.randint(0, size + 10)
            got = read_model(list(runs), size, stored, off, length)
            assert got == logical[off : off + length]
            assert all(n > 0 for _, n in pieces(SparseMap.of(runs), size, off, length))

def test_make_map_rejects_what_gnu_tar_calls_malformed() -> None:
    assert make_map([(10, 5), (5, 1)], 100) is None  # out of order
    assert make_map([(0, 10), (5, 10)], 100) is None  # overlapping
    assert make_map([(90, 11)], 100) is None  # past the end
    assert list(make_map([(0, 0), (5, 5), (100, 0)], 100) or []) == [5, 5]  # empty runs go

def test_map_text_round_trip_and_damage() -> None:
    runs = make_map([(1, 2), (10, 3)], 20)
    assert runs is not None and decode_map(encode_map(runs), 20) == runs
    for bad in (b"1,2,3", b"5,1,1,1", b"1,x", b"19,5"):
        with pytest.raises(ValueError):
            decode_map(bad, 20)

def sparse_index() -> ShardIndex:
    index = ShardIndex(size=1 << 16, skipped={"device": 1}, notes={"leading-slash-removed": 1})
    index.add(Member(b"plain", "f", 512, 3, 7, 0o644))
    index.add(Member(b"holes", "f", 1536, 1 << 40, 7, 0o644, b"",
                     array("Q", [0, 10, (1 << 40) - 5, 5])))
    return index

def test_index_of_sparse_members_round_trips_as_format_2() -> None:
    index = sparse_index()
    data = encode_index(index)
    assert INDEX_FORMAT_SPARSE.encode() in data.partition(b"\n")[0]
    back = decode_index(data, expect_size=1 << 16)
    assert back.sparse == index.sparse and back.sizes == index.sizes
    assert back.notes == {"leading-slash-removed": 1}
    assert back.data_end() == 1536 + 15  # stored bytes, not the 1 TiB logical size

def test_index_without_sparse_members_is_unchanged_format_1() -> None:
    index = ShardIndex(size=4096)
    index.add(Member(b"a", "f", 512, 3, 7, 0o644))
    data = encode_index(index)
    assert json.loads(data.partition(b"\n")[0])["format"] == INDEX_FORMAT
    assert b"notes" not in data  # byte for byte what older versions wrote

def test_stale_or_forged_sparse_indexes_are_refused() -> None:
    old = ShardIndex(size=4096, skipped={"sparse": 2})  # written before sparse support
    with pytest.raises(IndexFormatError, match="predates sparse"):
        decode_index(encode_index(old))
    data = encode_index(sparse_index())
    head, _, body = data.partition(b"\n")
    for forged in (body.replace(b"\t0,10,", b"\t10,0,"),  # map out of order
                   body.replace(b"1099511627771,5", b"1099511627771,50")):  # past the end
        header = json.loads(head)
        header["body_sha256"] = hashlib.sha256(forged).hexdigest()
        with pytest.raises(IndexFormatError):
            decode_index(json.dumps(header).encode() + b"\n" + forged)
    # A format-1 reader must not take a sparse line for a plain one: format 2 says so.
    assert json.loads(head)["format"] != INDEX_FORMAT

def test_tree_keeps_sparse_maps_across_save_and_load(tmp_path: Path) -> None:
    tree = build_tree([sparse_index()])
    ino = tree.resolve(b"holes")
    assert ino is not None and tree.size[ino - 1] == 1 << 40
    assert tree.stored_size(ino) == 15
    tree.save(tmp_path / "tree")
    loaded = Tree.load(tmp_path / "tree")
    assert loaded.sparse == tree.sparse and loaded.stored_size(ino) == 15
    plain = loaded.resolve(b"plain")
    assert plain is not None and plain - 1 not in loaded.sparse

def test_sparse_reads_through_the_reader(tmp_path: Path) -> None:
    """GNU tar writes a sparse file (pax 1.0); reads at awkward offsets through the real
    reader over a file:// source give the logical bytes."""
    root = tmp_path / "root"
    root.mkdir()
    rng = random.Random(1)
    with open(root / "sp", "wb") as f:
        for i in range(5):
            f.seek(i * 300_000 + rng.randint(0, 999))
            f.write(rng.randbytes(rng.randint(1, 70_000)))
        f.truncate(1_600_000)
    logical = (root / "sp").read_bytes()
    shard = tmp_path / "sp.tar"
    subprocess.run(["tar", "--format=posix", "--sparse", "--sparse-version=1.0", "-C",
                    str(root), "-cf", str(shard), "sp"], check=True)
    with tarfile.open(shard) as tf:  # a second reader agrees on the logical bytes
        assert tf.extractfile("sp").read() == logical  # type: ignore[union-attr]

    cache = ShardCache(tmp_path / "cache", 1 << 30)
    cache.open()

    async def main() -> None:
        sources = Sources()
        catalog = await open_catalog([shard.as_uri()], sources, cache)
        reader = Reader(catalog, cache, sources)
        tree = catalog.tree
        ino = tree.resolve(b"sp")
        assert ino is not None and ino - 1 in tree.sparse
        ref, runs = tree.file_ref(ino), tree.sparse[ino - 1]
        assert ref.size == len(logical) and tree.stored_size(ino) < len(logical) // 2
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)
            for _ in range(300):
                off = rng.randint(0, len(logical) + 10)
                size = rng.choice([1, 4096, 131072, rng.randint(0, 400_000)])
                got = await read_sparse(reader, ref, runs, off, size)
                assert got == logical[off : off + size], (off, size)
            nursery.cancel_scope.cancel()
        await sources.aclose()

    try:
        trio.run(main)
    finally:
        cache.close()

