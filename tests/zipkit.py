"""Helpers for the zip tests: index a zip through the real ranged-read path (file:// source),
read members the way the mount does (stored range, decoded), and make odd zips."""

from __future__ import annotations

import io
import os
import random
import struct
import zipfile
from pathlib import Path

import trio

from shardfs.catalog.archives import index_zip
from shardfs.catalog.shardindex import ShardIndex, decode_index, encode_index
from shardfs.read.packed import decode
from shardfs.sources import Sources, SourceSettings

METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)


def index_file(path: Path) -> ShardIndex:
    """The index of a local zip, built as a mount builds it, and passed through its file
    format (encode + decode) so the published form is what is checked."""

    async def run() -> ShardIndex:
        sources = Sources(SourceSettings())
        try:
            url = path.resolve().as_uri()
            source = sources.for_url(url)
            info = await source.stat(url)
            return await index_zip(source, info, lambda n: None)
        finally:
            await sources.aclose()

    index = trio.run(run)
    return decode_index(encode_index(index), expect_size=index.size)


def read_members(path: Path, index: ShardIndex) -> dict[str, bytes]:
    """Every file member's bytes as the mount serves them (stored range, decoded)."""
    out = {}
    with open(path, "rb") as f:
        for pos, name in enumerate(index.paths):
            if index.kinds[pos] != ord("f"):
                continue
            packed = index.packed.get(pos)
            stored = index.stored_size(pos)
            f.seek(index.offsets[pos])
            raw = f.read(stored)
            assert len(raw) == stored
            out[name.decode()] = raw if packed is None else decode(packed, raw,
                                                                    index.sizes[pos])
    return out


def python_extraction(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}


def sample_files(seed: int = 0, n: int = 40) -> dict[str, bytes]:
    """Image-like files in class folders: random bytes (incompressible) with a compressible
    tail, some empty."""
    r = random.Random(seed)
    files = {}
    for i in range(n):
        body = r.randbytes(r.randint(0, 30000)) + b"x" * r.randint(0, 3000)
        files[f"class{i % 4}/img{i:03d}.jpg"] = body
    return files


def write_zip(path: Path, files: dict[str, bytes], methods=METHODS, **kw) -> Path:
    with zipfile.ZipFile(path, "w", **kw) as z:
        for i, (name, data) in enumerate(files.items()):
            z.writestr(name, data, compress_type=methods[i % len(methods)])
    return path


class NonSeekable(io.RawIOBase):
    """A write-only stream without seek/tell: zipfile then writes data descriptors."""

    def __init__(self, f) -> None:
        self.f = f

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.f.write(b)


def write_streamed_zip(path: Path, files: dict[str, bytes]) -> Path:
    with open(path, "wb") as raw, zipfile.ZipFile(NonSeekable(raw), "w") as z:
        for i, (name, data) in enumerate(files.items()):
            with z.open(zipfile.ZipInfo(name), "w") as w:
                w.write(data)
            del i
    return path


def patch(path: Path, old: bytes, new: bytes, count: int = -1) -> None:
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, count))


def central_entries(path: Path) -> list[int]:
    """Offsets of the central directory entries in a zip file."""
    data = path.read_bytes()
    out, pos = [], 0
    while (pos := data.find(b"PK\x01\x02", pos)) >= 0:
        out.append(pos)
        pos += 4
    return out


def set_central(path: Path, entry: int, field: str, value: int) -> None:
    """Overwrite one field of the central directory entry at `entry`."""
    at = {"crc": 16, "csize": 20, "usize": 24, "header": 42}[field]
    with open(path, "r+b") as f:
        f.seek(entry + at)
        f.write(struct.pack("<L", value))


def write_zip64_sparse(path: Path, big: int, tail: bytes) -> tuple[int, int]:
    """A zip whose first member is `big` zero bytes, stored, left as a hole in a sparse
    file, and whose second member (`tail`, stored) starts past 4 GiB: ZIP64 sizes and
    offsets. Returns (CRC of the big member, where the tail member's data starts). The big
    member's CRC is computed over zeros (cheap: crc32 of a zero block, repeated)."""
    import zlib

    crc, block = 0, bytes(1 << 24)
    left = big
    while left:
        n = min(left, len(block))
        crc = zlib.crc32(block[:n] if n < len(block) else block, crc)
        left -= n
    entries = []
    with open(path, "wb") as f:
        for name, size, crc_, data in ((b"big.bin", big, crc, None),
                                       (b"tail.bin", len(tail), zlib.crc32(tail), tail)):
            offset = f.tell()
            extra = struct.pack("<HHQQ", 1, 16, size, size)
            f.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 45, 0, 0, 0, 0x21, crc_,
                                0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra)) + name + extra)
            start = f.tell()
            if data is None:
                f.seek(size, os.SEEK_CUR)  # a hole: no disk used
            else:
                f.write(data)
            entries.append((name, size, crc_, offset, start))
        cd_start = f.tell()
        for name, size, crc_, offset, _ in entries:
            extra = struct.pack("<HHQQQ", 1, 24, size, size, offset)
            f.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 45 | 3 << 8, 45, 0, 0, 0, 0x21,
                                crc_, 0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra), 0, 0, 0,
                                0o100644 << 16, 0xFFFFFFFF) + name + extra)
        cd_end = f.tell()
        f.write(struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 2, 2,
                            cd_end - cd_start, cd_start))
        f.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, cd_end, 1))
        f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                            0xFFFFFFFF, 0))
    return crc, entries[1][4]
