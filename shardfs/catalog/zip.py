"""Pure parsing of zip archives into shard members (no I/O).

A zip is indexed from its end, with ranged reads, never downloaded whole:

1. `locate_directory(tail, tail_start, size)`: the end-of-central-directory record (searched
   backwards through the last 64 KiB + 22 bytes, the most a comment allows), and the ZIP64
   locator before it. When there is a ZIP64 record it says where; `zip64_directory()` reads it.
2. `parse_directory(data, where)`: every central directory entry -> `Entry` (names decoded
   as `unzip` on Linux does, ZIP64 extra fields, Info-ZIP Unicode path fields, mtimes,
   modes, encryption, method).
3. `members(entries, heads, where)`: the local header of each file entry (the caller reads
   `head_span()` bytes at each `entry.header`) gives where its data starts (local name and
   extra lengths can differ from the central directory's); out come `Member`s, with the
   same path rules as tar members, and the entries skipped, counted by reason.

Stored members are plain byte ranges of the shard, served like tar members. Compressed
members carry `packed = (codec, compressed size, CRC-32)`: their data is the compressed
range, decoded whole on read (shardfs/read/packed.py) and checked against the CRC. Sizes
come from the central directory, so data descriptors need no reading.

Symlinks (Info-ZIP `zip -y`) whose target is stored and short (read with the local header)
are links, kept only if they stay inside the tree (tar's rule).

Skipped (counted): encrypted entries, unsupported methods, compressed or long symlinks,
entries whose data lies outside the file or overlaps the central directory or
another entry (a "quoted overlap" zip bomb), bad local headers, unsafe names.
"""

from __future__ import annotations

import calendar
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field

from shardfs.catalog.tar import Member, _symlink_inside, normalize_path

EOCD = b"PK\x05\x06"
EOCD64_LOCATOR = b"PK\x06\x07"
EOCD64 = b"PK\x06\x06"
CENTRAL = b"PK\x01\x02"
LOCAL = b"PK\x03\x04"

# sig, disk, cd disk, entries here, entries, cd size, cd offset, comment length
_EOCD = struct.Struct("<4s4H2LH")
_LOCATOR = struct.Struct("<4sLQL")  # sig, disk, zip64 record offset, disks
# sig, record size, made by, needed, disk, cd disk, entries here, entries, cd size, cd offset
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")
LOCAL_SIZE = _LOCAL.size  # 30
TAIL = 65535 + _EOCD.size + _LOCATOR.size  # bytes from the end that hold both records
MAX_DIRECTORY = 1 << 30  # a central directory larger than this is refused (not a dataset)
MAX_PACKED = 256 << 20  # split RecordIO records are joined whole in memory: at most this size
_MAX_HEAD_SLACK = 1024  # local extra bytes read beyond the central directory's extra length
NAME_MAX_TARGET = 1024  # a stored symlink target longer than this is skipped

# Compression methods -> codec names (read/packed.py decodes them).
METHODS = {8: "deflate", 9: "deflate64", 12: "bzip2", 14: "lzma", 93: "zstd", 95: "xz"}
_FLAG_ENCRYPTED = 0x1
_FLAG_UTF8 = 0x800
_HOST_UNIX = 3
_S_IFMT, _S_IFLNK, _S_IFDIR = 0o170000, 0o120000, 0o040000


class ZipError(ValueError):
    """Not a zip, or a zip whose directory cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Directory:
    """Where the central directory is: its bytes are [start, start + size) of the file."""

    start: int
    size: int
    entries: int
    end: int  # where the end records begin
    zip64_at: int | None = None  # a ZIP64 end record to read first (offset), if any
    shift: int = 0  # bytes prepended to the zip (a self-extractor's stub): added to offsets


@dataclass(slots=True)
class Entry:
    path: bytes | None  # normalized, or None if unsafe
    is_dir: bool
    method: int
    flags: int
    crc: int
    csize: int
    usize: int
    header: int  # offset of the local header
    name_len: int  # central name and extra lengths (the local ones are read and checked)
    extra_len: int
    mtime: int
    mode: int
    symlink: bool = False
    leading_slash: bool = False
    root: bool = False  # a directory entry naming the archive's root ("./", "/")


@dataclass(slots=True)
class Listing:
    members: list[Member] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)


def locate_directory(tail: bytes, tail_start: int, size: int) -> Directory:
    """Find the end-of-central-directory record in `tail` (the file's last bytes, starting at
    `tail_start`); ZipError if there is none or it is inconsistent."""
    end = len(tail)
    while True:
        pos = tail.rfind(EOCD, 0, end)
        if pos < 0:
            raise ZipError("not a zip archive (no end of central directory record)")
        if pos + _EOCD.size <= len(tail):
            fields = _EOCD.unpack_from(tail, pos)
            # The comment must fit in the file (else a PK\5\6 inside a comment fooled us).
            if pos + _EOCD.size + fields[7] <= len(tail):
                break
        end = pos + 3  # look further back
    _, disk, cd_disk, _, entries, cd_size, cd_off, _ = fields
    eocd_at = tail_start + pos
    loc = pos - _LOCATOR.size
    if loc >= 0 and tail[loc : loc + 4] == EOCD64_LOCATOR:
        _, _, record, disks = _LOCATOR.unpack_from(tail, loc)
        if disks > 1:
            raise ZipError("multi-disk (split) zip archives are not supported")
        if record >= eocd_at:
            raise ZipError("ZIP64 end record points past the end record")
        return Directory(0, 0, 0, record, zip64_at=record)
    if disk or cd_disk:
        raise ZipError("multi-disk (split) zip archives are not supported")
    return _directory(cd_off, cd_size, entries, eocd_at, size)


def zip64_directory(record: bytes, record_at: int, size: int) -> Directory:
    """The directory a ZIP64 end record (its first 56 bytes, read at `record_at`) names."""
    if len(record) < _EOCD64.size or record[:4] != EOCD64:
        raise ZipError("bad ZIP64 end of central directory record")
    _, _, _, _, disk, cd_disk, _, entries, cd_size, cd_off = _EOCD64.unpack_from(record)
    if disk or cd_disk:
        raise ZipError("multi-disk (split) zip archives are not supported")
    return _directory(cd_off, cd_size, entries, record_at, size)


def _directory(cd_off: int, cd_size: int, entries: int, end: int, size: int) -> Directory:
    if cd_size > MAX_DIRECTORY:
        raise ZipError(f"central directory of {cd_size} bytes is too large")
    # Data prepended to the zip (a self-extractor's stub) shifts every offset by the same
    # amount: the directory ends where the end record begins (zipfile and unzip do this).
    start = end - cd_size
    if start < 0 or cd_off > start:
        raise ZipError("central directory lies outside the file")
    if entries > cd_size // _CENTRAL.size:
        raise ZipError(f"central directory of {cd_size} bytes cannot hold {entries} entries")
    return Directory(start, cd_size, entries, end, shift=start - cd_off)


def parse_directory(data: bytes, where: Directory) -> list[Entry]:
    """The central directory's entries (offsets already shifted, see Directory.shift)."""
    if len(data) != where.size:
        raise ZipError("central directory cut short")
    entries: list[Entry] = []
    dos_times: dict[int, int] = {}  # DOS date and time -> seconds (most entries share a few)
    pos = 0
    while pos < len(data):
        if data[pos : pos + 4] != CENTRAL:
            if len(entries) == where.entries and not data[pos:].strip(b"\0"):
                break
            raise ZipError(f"bad central directory entry at byte {where.start + pos}")
        if pos + _CENTRAL.size > len(data):
            raise ZipError("central directory entry cut short")
        (_, made, _, flags, method, dtime, ddate, crc, csize, usize, name_len, extra_len,
         comment_len, disk, _, external, header) = _CENTRAL.unpack_from(data, pos)
        start = pos + _CENTRAL.size
        end = start + name_len + extra_len + comment_len
        if end > len(data):
            raise ZipError("central directory entry cut short")
        raw = data[start : start + name_len]
        extra = data[start + name_len : start + name_len + extra_len]
        if extra and 0xFFFFFFFF in (usize, csize, header):
            usize, csize, header, disk = _zip64(extra, usize, csize, header, disk)
        if disk not in (0, 0xFFFF):
            raise ZipError("multi-disk (split) zip archives are not supported")
        host = made >> 8
        if not extra and raw.isascii() and (host == _HOST_UNIX or b"\\" not in raw):
            name = raw  # the common case, without the checks of _decode_name
        else:
            name = _decode_name(raw, flags, extra, host)
        unix_mode = external >> 16 if host == _HOST_UNIX else 0
        is_dir = name.endswith(b"/") or bool(external & 0x10) or \
            unix_mode & _S_IFMT == _S_IFDIR
        leading = name.startswith(b"/")
        path = normalize_path(name.rstrip(b"/").lstrip(b"/"))
        mode = unix_mode & 0o7777 or (0o755 if is_dir else 0o644)
        entries.append(Entry(
            path=path, is_dir=is_dir, method=method, flags=flags, crc=crc, csize=csize,
            usize=usize, header=header + where.shift, name_len=name_len, extra_len=extra_len,
            mtime=_mtime(extra, dtime, ddate, dos_times), mode=mode,
            symlink=unix_mode & _S_IFMT == _S_IFLNK, leading_slash=leading,
            root=is_dir and not name.strip(b"./")))
        pos = end
    if len(entries) != where.entries and where.entries != 0xFFFF:
        raise ZipError(f"central directory holds {len(entries)} entries, its end record "
                       f"says {where.entries}")
    return entries


def _extra_fields(extra: bytes):
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<2H", extra, pos)
        yield tag, extra[pos + 4 : pos + 4 + size]
        pos += 4 + size


def _zip64(extra: bytes, usize: int, csize: int, header: int, disk: int
           ) -> tuple[int, int, int, int]:
    """Sizes and offset from the ZIP64 extra field, for those the header marks 0xFFFFFFFF."""
    for tag, body in _extra_fields(extra):
        if tag != 0x0001:
            continue
        values = []
        for i in range(len(body) // 8):
            values.append(struct.unpack_from("<Q", body, 8 * i)[0])
        take = iter(values)
        try:
            if usize == 0xFFFFFFFF:
                usize = next(take)
            if csize == 0xFFFFFFFF:
                csize = next(take)
            if header == 0xFFFFFFFF:
                header = next(take)
        except StopIteration:
            raise ZipError("ZIP64 extra field too short") from None
        if disk == 0xFFFF and len(body) % 8 == 4:
            disk = struct.unpack_from("<L", body, len(body) - 4)[0]
        break
    return usize, csize, header, disk


def _decode_name(raw: bytes, flags: int, extra: bytes, host: int) -> bytes:
    """The name as UTF-8 bytes, as unzip extracts it on Linux: the Info-ZIP Unicode path
    field when its CRC matches the name; UTF-8 when flagged or when the bytes are valid
    UTF-8 (Info-ZIP on Linux writes UTF-8 without the flag); else CP437 (MS-DOS). Names
    from non-Unix hosts with backslashes use them as separators."""
    for tag, body in _extra_fields(extra):
        if tag == 0x7075 and len(body) >= 5 and body[0] == 1 and \
                struct.unpack_from("<L", body, 1)[0] == zlib.crc32(raw):
            try:
                body[5:].decode("utf-8")
                raw = body[5:]
                flags |= _FLAG_UTF8
            except UnicodeDecodeError:
                pass
            break
    if not flags & _FLAG_UTF8:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raw = raw.decode("cp437").encode("utf-8")
    if host != _HOST_UNIX and b"\\" in raw:
        raw = raw.replace(b"\\", b"/")
    return raw


def _mtime(extra: bytes, dtime: int, ddate: int, cache: dict[int, int]) -> int:
    """The Info-ZIP extended timestamp (UTC) if present, else the DOS time (local time,
    taken as UTC: the zip does not say which zone)."""
    if extra:
        for tag, body in _extra_fields(extra):
            if tag == 0x5455 and len(body) >= 5 and body[0] & 1:
                return struct.unpack_from("<l", body, 1)[0]
    key = ddate << 16 | dtime
    seconds = cache.get(key)
    if seconds is None:
        seconds = cache[key] = _dos_time(dtime, ddate)
    return seconds


def _dos_time(dtime: int, ddate: int) -> int:
    year, month, day = 1980 + (ddate >> 9), (ddate >> 5) & 0xF, ddate & 0x1F
    hour, minute, second = dtime >> 11, (dtime >> 5) & 0x3F, (dtime & 0x1F) * 2
    try:
        return calendar.timegm((year, max(month, 1), max(day, 1), hour, minute, second))
    except (ValueError, OverflowError):
        return 0


def head_span(entry: Entry) -> int:
    """Bytes to read at `entry.header` for its local header, name and extra field (local
    extras may be longer than the central one: zipalign, Info-ZIP's own fields)."""
    target = entry.csize if entry.symlink and entry.csize <= NAME_MAX_TARGET else 0
    return LOCAL_SIZE + entry.name_len + entry.extra_len + _MAX_HEAD_SLACK + target


def data_start(entry: Entry, head: bytes) -> int | None:
    """Where the entry's data begins, from its local header `head` (read at entry.header);
    None if the header is not there. Raises nothing: a bad header skips the entry."""
    if len(head) < LOCAL_SIZE or head[:4] != LOCAL:
        return None
    name_len, extra_len = _LOCAL.unpack_from(head)[9:11]
    return entry.header + LOCAL_SIZE + name_len + extra_len


def members(entries: list[Entry], starts: list[int | None], where: Directory,
            heads: list[bytes] | None = None) -> Listing:
    """Members from central entries and their data starts (None: bad local header); `heads`
    (the bytes read at each entry's local header) hold the targets of stored symlinks."""
    out = Listing()
    files: list[tuple[int, int, int]] = []  # (header offset, data end, entry position)
    for i, (entry, start) in enumerate(zip(entries, starts, strict=True)):
        if entry.path is None:
            out.skipped["root-dir" if entry.root else "unsafe-name"] += 1
            continue
        if entry.leading_slash:
            out.notes["leading-slash-removed"] += 1
        if entry.is_dir:
            out.members.append(Member(entry.path, "d", 0, 0, entry.mtime, entry.mode))
            continue
        if entry.flags & _FLAG_ENCRYPTED or entry.method == 99:
            out.skipped["encrypted"] += 1
            continue
        if entry.symlink:
            _symlink(entry, start, heads[i] if heads else b"", out)
            continue
        if entry.method != 0 and entry.method not in METHODS:
            out.skipped[f"unsupported-method-{entry.method}"] += 1
            continue
        if start is None:
            out.skipped["bad-local-header"] += 1
            continue
        if entry.method == 0 and entry.csize != entry.usize:
            out.skipped["bad-sizes"] += 1
            continue
        if start + entry.csize > where.start:
            out.skipped["data-outside-file"] += 1
            continue
        files.append((entry.header, start + entry.csize, i))
    # A member whose local header lies inside another's data overlaps it: the "quoted
    # overlap" zip bomb. unzip refuses such archives; we skip the overlapping entries.
    files.sort()
    kept: set[int] = set()
    reach = 0
    for header, end, i in files:
        if header < reach:
            out.skipped["overlapping"] += 1
            continue
        reach = end
        kept.add(i)
    for i, (entry, start) in enumerate(zip(entries, starts, strict=True)):
        if i not in kept:
            continue
        assert entry.path is not None and start is not None
        packed = None if entry.method == 0 else (METHODS[entry.method], entry.csize, entry.crc)
        out.members.append(Member(entry.path, "f", start, entry.usize, entry.mtime,
                                  entry.mode, b"", None, packed))
    return out



def _symlink(entry: Entry, start: int | None, head: bytes, out: Listing) -> None:
    """A symlink (Info-ZIP `zip -y`): its target is its data, stored, read with its local
    header. Links that would leave the tree are skipped as for tar."""
    at = start - entry.header if start is not None else -1
    if entry.method != 0 or at < 0 or entry.csize > NAME_MAX_TARGET or \
            len(head) < at + entry.csize:
        out.skipped["zip-symlink"] += 1
        return
    target = head[at : at + entry.csize]
    assert entry.path is not None
    if not target or not _symlink_inside(entry.path, target):
        out.skipped["symlink-escapes"] += 1
        return
    out.members.append(Member(entry.path, "l", start or 0, 0, entry.mtime, entry.mode,
                              target))
