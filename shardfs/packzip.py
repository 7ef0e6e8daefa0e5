"""The zip layout of `shardfs pack --format zip`: stored (uncompressed) members, so every
member is a plain byte range of the shard, served like a tar member.

Reproducible like the tar shards: fixed DOS time (unless --keep-mtime), mode 0644 in Unix
external attributes, UTF-8 names (flagged when not ASCII), no data descriptors (sizes and
CRC-32 are in every local header, which streaming readers such as Java's ZipInputStream
need for stored members), ZIP64 fields only where a size or offset needs them.
"""

from __future__ import annotations

import struct
import time

_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_EOCD = struct.Struct("<4s4H2LH")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR = struct.Struct("<4sLQL")
_MAX32 = 0xFFFFFFFF
_UNIX = 3 << 8
_FILE_ATTR = 0o100644 << 16
_UTF8 = 0x800


def _dos_time(mtime: int) -> tuple[int, int]:
    t = time.gmtime(max(mtime, 315532800))  # DOS time starts in 1980 (read back as UTC)
    return (t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2,
            max(0, t.tm_year - 1980) << 9 | t.tm_mon << 5 | t.tm_mday)


def _flags(name: bytes) -> int:
    return 0 if name.isascii() else _UTF8


def local_header(name: bytes, size: int, mtime: int, crc: int = 0) -> bytes:
    """The local header and name of a stored member (CRC patched in after the data, at
    CRC_AT; sizes are known up front)."""
    dtime, ddate = _dos_time(mtime)
    extra = b""
    version = 20
    if size >= _MAX32:
        extra = struct.pack("<HHQQ", 1, 16, size, size)
        version = 45
    small = min(size, _MAX32)
    return _LOCAL.pack(b"PK\x03\x04", version, _flags(name), 0, dtime, ddate, crc, small,
                       small, len(name), len(extra)) + name + extra


CRC_AT = 14  # offset of the CRC-32 field in a local header


def local_header_size(name: bytes, size: int) -> int:
    return _LOCAL.size + len(name) + (20 if size >= _MAX32 else 0)


def central_entry(name: bytes, size: int, mtime: int, crc: int, header: int) -> bytes:
    dtime, ddate = _dos_time(mtime)
    values = [v for v in (size, size) if v >= _MAX32] if size >= _MAX32 else []
    if header >= _MAX32:
        values.append(header)
    extra = struct.pack("<HH", 1, 8 * len(values)) + b"".join(
        struct.pack("<Q", v) for v in values) if values else b""
    version = 45 if values else 20
    small = min(size, _MAX32)
    return _CENTRAL.pack(b"PK\x01\x02", _UNIX | version, version, _flags(name), 0, dtime,
                         ddate, crc, small, small, len(name), len(extra), 0, 0, 0,
                         _FILE_ATTR, min(header, _MAX32)) + name + extra


def central_entry_size(name: bytes, size: int, header: int) -> int:
    fields = (2 if size >= _MAX32 else 0) + (header >= _MAX32)
    return _CENTRAL.size + len(name) + (4 + 8 * fields if fields else 0)


def end_records(entries: int, cd_start: int, cd_size: int) -> bytes:
    """End of central directory (with ZIP64 records before it when needed)."""
    out = b""
    if entries > 0xFFFF or cd_start >= _MAX32 or cd_size >= _MAX32:
        at = cd_start + cd_size
        out = _EOCD64.pack(b"PK\x06\x06", _EOCD64.size - 12, _UNIX | 45, 45, 0, 0, entries,
                           entries, cd_size, cd_start)
        out += _LOCATOR.pack(b"PK\x06\x07", 0, at, 1)
    return out + _EOCD.pack(b"PK\x05\x06", 0, 0, min(entries, 0xFFFF), min(entries, 0xFFFF),
                            min(cd_size, _MAX32), min(cd_start, _MAX32), 0)


def end_size(entries: int, cd_start: int, cd_size: int) -> int:
    return len(end_records(entries, cd_start, cd_size))
