"""The record of a `.part` file: how much of a shard a fetch has written, block by block.

A whole-shard fetch that a daemon's death interrupts (kill -9, a crash, `shardfs restart`)
leaves `shards/KEY.part`; the next daemon on the cache dir continues it from what is on disk
instead of from byte 0 (reader.py). For that it must know which prefix of the part file is
real shard data. The file itself cannot say: it is created sparse at full size, so a byte
never written reads as zero, and SEEK_HOLE reports data in whole filesystem blocks (a block
half written is "data", zeros included), sees a split fetch's later runs as data too, and on
filesystems without hole tracking (or with preallocation) calls the whole file data. So the
fetch keeps a record, `parts/KEY.crc`:

    MAGIC, the shard's size (8 bytes, little endian), then one CRC-32C (4 bytes, little
    endian) per BLOCK of the shard's contiguous prefix, appended as the prefix grows past
    each block. (Records written before session 20 start `shardfs-part-1` and hold zlib's
    CRC-32s; a daemon taking one over checks and continues it with those.)

A block's CRC is appended only after its bytes were written, computed from the bytes written
(as they stream, PrefixCrcs; or read back from the file once a split fetch's prefix came by
several GETs, block_crcs), so after the writer is SIGKILLed the record never claims more than
the page cache holds; after
a power loss or OS crash neither file's pages need be on disk, which is why the next daemon
checks every claimed block against its CRC before it uses it (verify_prefix): the prefix
kept is the blocks that match, up to the first that does not. A torn last entry (4 bytes
half written) is ignored. The whole shard is still checked against the index's digest when
the fetch completes, where the index has one: a CRC-32C from the blocks' CRCs
(PrefixCrcs.whole, no second pass over the bytes), or a digest of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfs.util.checksum import Buffer, Crc32c, crc32c_of_blocks, crc32c_value
from shardfs.util.fileio import file_views, pwrite_all

MAGIC = b"shardfs-part-2\n"  # CRC-32C entries
MAGIC_CRC32 = b"shardfs-part-1\n"  # zlib CRC-32 entries (records of daemons before session 20)
_KIND_OF = {MAGIC: "crc32c", MAGIC_CRC32: "crc32"}
HEAD = len(MAGIC) + 8
BLOCK = 4 << 20  # a record entry per 4 MiB: at most this much is fetched again after a kill
_SIZE = struct.Struct("<Q")
_CRC = struct.Struct("<I")
log = logging.getLogger(__name__)


def crc_of(kind: str, data: Buffer, initial: int = 0) -> int:
    """A record entry's CRC of a block's bytes, going on from `initial` (both libraries
    release the GIL for large pieces)."""
    return crc32c_value(data, initial) if kind == "crc32c" else zlib.crc32(data, initial)


def block_crc(fd: int, start: int, end: int, kind: str = "crc32c") -> int:
    """The CRC of bytes [start, end) of a file (in a worker thread)."""
    crc = 0
    for view in file_views(fd, start, end - start):
        crc = crc_of(kind, view, crc)
    return crc


def block_crcs(fd: int, start: int, end: int, kind: str = "crc32c") -> list[int]:
    """The CRC of each BLOCK of bytes [start, end) of a file, both multiples of BLOCK (in a
    worker thread)."""
    return [block_crc(fd, pos, pos + BLOCK, kind) for pos in range(start, end, BLOCK)]


class PrefixCrcs:
    """The CRCs of a shard's BLOCKs, computed from its bytes as a fetch writes them in order
    from `start` (a multiple of BLOCK): no read back from the part file (which cost about as
    much as the CRC itself: a 4 MiB copy out of the page cache per block). Feed it only bytes
    already written, so that what `take` hands over may be recorded at once. The last block
    (ending at the shard's end) is not given: the fetch commits soon after.

    With CRC-32C entries it also gives the whole shard's CRC-32C (`whole`), from the blocks'
    CRCs (those before `start` are `before`, the record's) and the last block's bytes, which
    go on from them: the index's CRC-32C is checked with no second pass over the bytes."""

    __slots__ = ("_before", "_crc", "_done", "_every", "_start", "kind", "pos", "size")

    def __init__(self, start: int, size: int, kind: str = "crc32c",
                 before: list[int] | None = None) -> None:
        assert start % BLOCK == 0 or start >= size
        self.pos, self.size, self.kind, self._start = start, size, kind, start
        self._before = list(before or [])[: start // BLOCK]
        self._every: list[int] = []  # every block's CRC from start on (the last one's: never)
        self._done: list[int] = []
        self._crc: Crc32c | int = self._block_start()

    def _block_start(self) -> Crc32c | int:
        if self.kind != "crc32c":
            return 0
        if self.pos + BLOCK < self.size:
            return Crc32c()
        # The last block goes on from the CRC-32C of all blocks before it: its value is then
        # the whole shard's. (No record entry is made of it.)
        return Crc32c(crc32c_of_blocks(self._before + self._every, BLOCK))

    def update(self, data: Buffer) -> None:
        """Bytes [pos, pos+len(data)) of the shard (in a worker thread: the CRCs release the
        GIL)."""
        while data:
            room = BLOCK - self.pos % BLOCK
            piece = data if len(data) <= room else data[:room]  # a copy only at a block's end
            data = data[room:] if len(data) > room else b""
            if isinstance(self._crc, Crc32c):
                self._crc.update(piece)
            else:
                self._crc = zlib.crc32(piece, self._crc)
            self.pos += len(piece)
            if self.pos % BLOCK == 0 and self.pos < self.size:
                crc = self._crc.value() if isinstance(self._crc, Crc32c) else self._crc
                self._done.append(crc)
                self._every.append(crc)
                self._crc = self._block_start()

    def take(self) -> list[int]:
        """The CRCs of the blocks completed since the last call, in order."""
        done, self._done = self._done, []
        return done

    def whole(self) -> str | None:
        """The whole shard's CRC-32C (hex) once every byte went through, where it is known
        (CRC-32C entries, and the last block begun here)."""
        if self.kind != "crc32c" or self.pos != self.size:
            return None
        if self.size == 0:
            return "00000000"
        last = (self.size - 1) // BLOCK  # the last block's number
        if self._start > last * BLOCK or len(self._before) + len(self._every) != last:
            return None  # its bytes, or a block's CRC before it, did not come through here
        assert isinstance(self._crc, Crc32c)
        return self._crc.hexdigest()


@dataclass(slots=True)
class PartRecord:
    """The open record of one part file; `blocks` entries are written."""

    path: Path
    fd: int
    size: int
    crcs: list[int]
    kind: str = "crc32c"  # of the entries: "crc32" in records of daemons before session 20

    @property
    def claimed(self) -> int:
        """Bytes [0, claimed) the record says were written (not yet verified)."""
        return min(len(self.crcs) * BLOCK, self.size)

    @classmethod
    def create(cls, path: Path, size: int) -> PartRecord:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pwrite_all(fd, MAGIC + _SIZE.pack(size), 0)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, size, [])

    @classmethod
    def load(cls, path: Path, size: int) -> PartRecord | None:
        """The record of a part file of `size` bytes left by an earlier daemon, or None if
        it is missing, unreadable, or for another size."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            data = os.pread(fd, HEAD + 4 * (size // BLOCK + 1), 0)
            kind = _KIND_OF.get(data[: len(MAGIC)])
            if kind is None or len(data) < HEAD or \
                    _SIZE.unpack_from(data, len(MAGIC))[0] != size:
                os.close(fd)
                return None
        except OSError:
            os.close(fd)
            return None
        count = (len(data) - HEAD) // 4  # a torn last entry is not counted
        crcs = [_CRC.unpack_from(data, HEAD + 4 * i)[0] for i in range(count)]
        return cls(path, fd, size, crcs, kind)

    def extend(self, crcs: list[int]) -> None:
        """Append the CRCs of the next blocks (one write). OSError: not recorded (a full
        disk): the caller's fetch goes on, and a daemon taking over fetches from what was."""
        if crcs:
            pwrite_all(self.fd, b"".join(map(_CRC.pack, crcs)), HEAD + 4 * len(self.crcs))
            self.crcs.extend(crcs)

    def unrecorded(self, exc: OSError) -> None:
        log.warning("cannot record the progress of a fetch (%s): a daemon taking over "
                    "fetches it from %d", exc, len(self.crcs) * BLOCK)

    def verify_prefix(self, part_fd: int, digest: Any | None = None) -> int:
        """Check the claimed blocks of the part file against their CRCs, in order; return
        the length of the prefix that matches (a multiple of BLOCK, or the size) and forget
        the entries past it. `digest` (a hashlib object), if given, is fed that prefix.
        Blocking: run it in a worker thread."""
        good = 0
        for i, crc in enumerate(self.crcs):
            start = i * BLOCK
            end = min(start + BLOCK, self.size)
            try:
                data = os.pread(part_fd, end - start, start)
            except OSError:
                break
            if len(data) != end - start or crc_of(self.kind, data) != crc:
                break
            if digest is not None:
                digest.update(data)
            good = i + 1
        if good < len(self.crcs):
            del self.crcs[good:]
            os.ftruncate(self.fd, HEAD + 4 * good)
        return min(good * BLOCK, self.size)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
