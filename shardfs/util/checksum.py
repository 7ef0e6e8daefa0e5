"""Whole-shard checksums: what an index records of a shard's bytes, and what a fetch checks.

An indexer that sees every byte of a shard (`shardfs pack`, the streaming indexer, the
scan of a compressed local shard) records the shard's sha256 and its CRC-32C. A complete
fetch is checked against one of them before the shard is committed to the cache:

- CRC-32C where the index has one and the CPU computes it (SSE 4.2 / ARMv8 CRC instructions,
  through the `crc32c` package): ~0.07 ms per MiB against sha256's ~0.64 on the 2-core test
  machine, which is most of what checking costs a cold ~24 KiB file (issue 26). It is the
  check S3, GCS and HDFS use for data integrity: it catches every burst error up to 32 bits
  and all but 2^-32 of random corruptions; it does not resist a deliberate forgery, which
  needs write access to the store (and the index beside the shard) anyway.
- sha256 otherwise (indexes written before CRC-32C was recorded, or a CPU without the
  instructions), and wherever the index has one when the mount is told `verify: sha256`.

Both take any buffer (`bytes`, a `memoryview` of a reused buffer), so bytes a source wrote
straight into the cache are read back for their check into one buffer, not fresh memory per
piece (`file_views`; docs/sources.md, "Whole-shard downloads spliced into the cache"). The
`crc32c` package (ICRAR, LGPL-2.1-or-later, a C extension) replaced google-crc32c, whose
functions take only `bytes` and keep the GIL below 1 MiB (docs/benchmarks-notes.md,
"Downloads spliced into the cache").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import crc32c as _crc32c

from shardfs.util.fileio import file_views

# The package computes in C either way; "fast" is with the CPU's CRC instructions (without
# them sha256 is preferred: shard_check).
FAST_CRC32C: bool = bool(_crc32c.hardware_based)
# The package releases the GIL for pieces of at least this size (its default). Smaller ones
# are joined first: a hashing thread holding the GIL through a batch of small pieces stalls
# the event loop for up to Python's switch interval (5 ms; measured with 16 KiB pieces).
_GIL_FREE = 32 << 10
Buffer = bytes | bytearray | memoryview
VERIFY_MODES = ("auto", "sha256")


class Digest(Protocol):
    def update(self, data: Buffer, /) -> None: ...

    def hexdigest(self) -> str: ...


def crc32c_value(data: Buffer, initial: int = 0) -> int:
    """The CRC-32C of `data`, going on from `initial` (the CRC of the bytes before it). The
    GIL is released for pieces of 32 KiB and more (the package's default): a hashing thread
    does not stall the event loop."""
    return _crc32c.crc32c(data, initial)


class Crc32c:
    """CRC-32C (Castagnoli) of a stream of bytes, hashlib-style: update(), hexdigest()
    (8 lowercase hex digits), value(). Safe to feed from a worker thread."""

    __slots__ = ("_crc", "_pending", "_pending_len")

    def __init__(self, initial: int = 0) -> None:
        self._crc = initial  # the CRC of bytes before these, to go on from
        self._pending: list[bytes] = []
        self._pending_len = 0

    def update(self, data: Buffer, /) -> None:
        if self._pending_len:  # topped up to _GIL_FREE from data's head, not joined whole
            need = _GIL_FREE - self._pending_len
            if len(data) < need:
                self._pending.append(bytes(data))
                self._pending_len += len(data)
                return
            self._pending.append(bytes(data[:need]))
            self._flush()
            data = memoryview(data)[need:]
        if len(data) >= _GIL_FREE:
            self._crc = _crc32c.crc32c(data, self._crc)
        elif len(data):
            self._pending.append(bytes(data))
            self._pending_len = len(data)

    def _flush(self) -> None:
        if self._pending:
            self._crc = _crc32c.crc32c(b"".join(self._pending), self._crc)
            self._pending.clear()
            self._pending_len = 0

    def value(self) -> int:
        self._flush()
        return self._crc

    def hexdigest(self) -> str:
        return f"{self.value():08x}"


class KnownDigest:
    """A digest already computed (e.g. combined from block CRCs), hashlib-style."""

    __slots__ = ("_hex",)

    def __init__(self, hexdigest: str) -> None:
        self._hex = hexdigest

    def update(self, data: Buffer, /) -> None:
        raise TypeError("a known digest takes no more bytes")

    def hexdigest(self) -> str:
        return self._hex


# -- CRC-32C of a concatenation from the CRCs of its parts ------------------------------------
# crc(A + B) = Z(crc(A)) ^ crc(B), Z the linear map that runs len(B) zero bytes through the
# CRC register (it holds because CRC-32C's initial value and final XOR are equal). Z is a
# 32x32 matrix over GF(2), kept as 32 column words; powers of the one-zero-bit map build it.
_POLY = 0x82F63B78  # CRC-32C's polynomial, bit-reversed (the register shifts right)


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _after(second: list[int], first: list[int]) -> list[int]:
    """The map that applies `first`, then `second`."""
    return [_times(second, column) for column in first]


def _one_zero_byte() -> list[int]:
    """Z for one zero byte: the one-zero-bit map applied 8 times."""
    power = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    for _ in range(3):  # 1 -> 2 -> 4 -> 8 bits
        power = _after(power, power)
    return power


# Z for 2**k zero bytes, k = 0, 1, ... (built as needed, each from the one before): shifting a
# CRC by any length is one map-times-vector product per set bit of the length (~30 µs).
_POWER_MAPS: list[list[int]] = []


def _shifted(crc: int, nbytes: int) -> int:
    """`crc` run through `nbytes` zero bytes (the Z of crc32c_combine)."""
    maps = _POWER_MAPS
    if not maps:
        maps.append(_one_zero_byte())
    k = 0
    while nbytes:
        while k >= len(maps):
            maps.append(_after(maps[-1], maps[-1]))
        if nbytes & 1:
            crc = _times(maps[k], crc)
        nbytes >>= 1
        k += 1
    return crc


def crc32c_combine(first: int, second: int, second_len: int) -> int:
    """The CRC-32C of A + B from A's (`first`), B's (`second`) and B's length: no second pass
    over the bytes (blocks of a part record, pieces of a shard that came out of order)."""
    return _shifted(first, second_len) ^ second


def crc32c_of_blocks(crcs: Iterable[int], block: int) -> int:
    """The CRC-32C of consecutive blocks of `block` bytes each from their own CRC-32Cs."""
    crc = 0
    for i, part in enumerate(crcs):
        crc = part if i == 0 else crc32c_combine(crc, part, block)
    return crc


def crc32c_of_runs(runs: Iterable[tuple[int, int, int]], size: int) -> int | None:
    """The CRC-32C of bytes [0, size) from (start, end, crc) of runs that tile them exactly
    (any order); None when they do not (a gap, an overlap)."""
    crc, pos = 0, 0
    for start, end, part in sorted(runs):
        if start != pos or end < start:
            return None
        crc = crc32c_combine(crc, part, end - start) if pos else part
        pos = end
    return crc if pos == size else None


class ShardSums:
    """Both digests an indexer records of a whole shard (sha256, CRC-32C)."""

    __slots__ = ("_crc32c", "_sha256")

    def __init__(self) -> None:
        self._sha256 = hashlib.sha256()
        self._crc32c = Crc32c()

    def update(self, data: Buffer, /) -> None:
        self._sha256.update(data)
        self._crc32c.update(data)

    def hexdigests(self) -> tuple[str, str]:
        """(sha256, crc32c)"""
        return self._sha256.hexdigest(), self._crc32c.hexdigest()


def valid_crc32c(value: object) -> bool:
    """Whether an index's "crc32c" field is well formed (8 lowercase hex digits)."""
    return (isinstance(value, str) and len(value) == 8
            and all(c in "0123456789abcdef" for c in value))


@dataclass(frozen=True, slots=True)
class ShardCheck:
    """What a complete fetch of one shard is checked against."""

    kind: str  # "crc32c" or "sha256"
    expected: str  # hex digest from the index

    def digest(self) -> Digest:
        return Crc32c() if self.kind == "crc32c" else hashlib.sha256()

    def matches(self, digest: Digest) -> bool:
        return digest.hexdigest() == self.expected


def shard_check(sha256: str | None, crc32c: str | None, verify: str = "auto") -> ShardCheck | None:
    """The check for a shard whose index recorded these; None where it recorded neither (e.g.
    a local tar indexed by walking its headers). `verify` "sha256" prefers sha256."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
    recorded = {"crc32c": crc32c, "sha256": sha256}
    # Without the CPU's CRC instructions CRC-32C is no cheaper than sha256: the fallback.
    order = ("crc32c", "sha256") if verify == "auto" and FAST_CRC32C else ("sha256", "crc32c")
    for kind in order:
        if expected := recorded[kind]:
            return ShardCheck(kind, expected)
    return None


def digest_of_file(check: ShardCheck, fd: int, size: int) -> Digest:
    """The digest of bytes [0, size) of a file (a shard filled out of order; in a thread)."""
    digest = check.digest()
    for view in file_views(fd, 0, size):
        digest.update(view)
    return digest
