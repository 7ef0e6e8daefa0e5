"""One shard's member list in columnar form, and its on-disk index file format.

Columns (not one object per member) keep 1.3 M members affordable in memory.

Index file format (`<shard>.shardfs.idx`, also cached under the cache dir):
    line 1: JSON header {"format": "shardfs-index/1", "size": ..., "sha256": ...|null,
            ["crc32c": "8 hex digits",] "members": N, "body_sha256": ...,
            "skipped": {...}[, "notes": {...}]}
    then one line per member: KIND \t OFFSET \t SIZE \t MTIME \t MODE \t PATH [\t LINKNAME]
with backslash escapes for backslash, tab and newline inside PATH/LINKNAME (bytes, not text).
"crc32c" (the whole shard's CRC-32C, util/checksum.py) is written beside "sha256" where the
indexer saw every byte; readers that predate it ignore it, and a fetch of a shard whose index
lacks it is checked against the sha256.

A shard with sparse members gets format "shardfs-index/2": the line of a sparse file has a
7th field, its sparse map (`off,len,off,len...`, see sparse.py), and SIZE is its logical
size. Shards without sparse members keep writing /1, byte for byte as before; a reader that
knows only /1 refuses a /2 index (and scans the shard) rather than misreading it. A /1 index
that counted skipped "sparse" members was written before sparse members were served: it is
refused as stale so that the shard is scanned again.

A shard with compressed members (zip deflate etc., split RecordIO records: see zip.py,
recordio.py) gets format "shardfs-index/3": such a member's line has a 7th field
`@CODEC,STORED,CRC32` (stored size and CRC in decimal), OFFSET is where its stored bytes
begin and SIZE is its decoded size. /3 may also hold sparse maps (7th fields that start with
a digit). Shards without such members keep writing /1 or /2 as before.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardfs.catalog.sparse import Runs, decode_map, encode_map, stored_size
from shardfs.catalog.tar import Member, _symlink_inside, normalize_path
from shardfs.util.checksum import valid_crc32c

INDEX_FORMAT = "shardfs-index/1"
INDEX_FORMAT_SPARSE = "shardfs-index/2"  # written only for shards with sparse members
INDEX_FORMAT_PACKED = "shardfs-index/3"  # written only for shards with compressed members
_FORMATS = (INDEX_FORMAT, INDEX_FORMAT_SPARSE, INDEX_FORMAT_PACKED)
# Codecs of compressed members (read/packed.py decodes each).
PACKED_CODECS = frozenset(("deflate", "deflate64", "bzip2", "lzma", "zstd", "xz", "recordio"))
Packed = tuple[str, int, int]  # (codec, stored size, CRC-32; 0 where the codec has none)
INDEX_SUFFIX = ".shardfs.idx"

KIND_FILE, KIND_DIR, KIND_LINK = ord("f"), ord("d"), ord("l")
_KINDS = frozenset((KIND_FILE, KIND_DIR, KIND_LINK))


class IndexFormatError(ValueError):
    """An index file that is corrupt, of another format, or for another shard."""


@dataclass(slots=True)
class ShardIndex:
    size: int  # size of the shard the index describes
    sha256: str | None = None  # of the whole shard, when the indexer saw every byte
    crc32c: str | None = None  # likewise (8 hex digits): the cheaper check (util/checksum.py)
    compression: str | None = None  # "gzip", "zstd", "lz4" for compressed shards
    tar_size: int | None = None  # decompressed size of a compressed shard
    paths: list[bytes] = field(default_factory=list)
    kinds: bytearray = field(default_factory=bytearray)
    offsets: array = field(default_factory=lambda: array("Q"))
    sizes: array = field(default_factory=lambda: array("Q"))
    mtimes: array = field(default_factory=lambda: array("q"))
    modes: array = field(default_factory=lambda: array("H"))
    links: dict[int, bytes] = field(default_factory=dict)  # member position -> symlink target
    sparse: dict[int, Runs] = field(default_factory=dict)  # member position -> sparse map
    packed: dict[int, Packed] = field(default_factory=dict)  # member position -> codec etc.
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    notes: dict[str, int] = field(default_factory=dict)  # members fixed up (tar.py), by kind

    def __len__(self) -> int:
        return len(self.paths)

    def add(self, member: Member) -> None:
        if member.kind == "l":
            self.links[len(self.paths)] = member.linkname
        elif member.sparse is not None:
            self.sparse[len(self.paths)] = member.sparse
        elif member.packed is not None:
            self.packed[len(self.paths)] = member.packed
        self.paths.append(member.path)
        self.kinds.append(ord(member.kind))
        self.offsets.append(member.offset)
        self.sizes.append(member.size)
        self.mtimes.append(member.mtime)
        self.modes.append(member.mode)

    def extend(self, members: Iterable[Member]) -> None:
        for member in members:
            self.add(member)

    @property
    def data_size(self) -> int:
        """Bytes of plain tar the member offsets refer to (what the cache holds)."""
        return self.tar_size if self.tar_size is not None else self.size

    def stored_size(self, pos: int) -> int:
        """Bytes member `pos` takes in the shard (less than its size if it is sparse)."""
        if self.packed and pos in self.packed:
            return self.packed[pos][1]
        runs = self.sparse.get(pos) if self.sparse else None
        return self.sizes[pos] if runs is None else stored_size(runs)

    def data_end(self) -> int:
        """Largest data end offset: a shard smaller than this cannot hold these members."""
        if self.sparse or self.packed:
            return max((self.offsets[i] + self.stored_size(i) for i in range(len(self.paths))),
                       default=0)
        return max((o + s for o, s in zip(self.offsets, self.sizes, strict=True)), default=0)


def _escape(raw: bytes) -> bytes:
    if b"\\" in raw or b"\t" in raw or b"\n" in raw:
        return raw.replace(b"\\", b"\\\\").replace(b"\t", b"\\t").replace(b"\n", b"\\n")
    return raw


def _unescape(raw: bytes) -> bytes:
    if b"\\" not in raw:
        return raw
    out = bytearray()
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == 0x5C and i + 1 < len(raw):
            nxt = raw[i + 1]
            out.append({0x74: 0x09, 0x6E: 0x0A}.get(nxt, nxt))
            i += 2
        else:
            out.append(c)
            i += 1
    return bytes(out)


def encode_index(index: ShardIndex) -> bytes:
    lines = []
    for i, path in enumerate(index.paths):
        line = b"%c\t%d\t%d\t%d\t%d\t%s" % (
            index.kinds[i],
            index.offsets[i],
            index.sizes[i],
            index.mtimes[i],
            index.modes[i],
            _escape(path),
        )
        if i in index.links:
            line += b"\t" + _escape(index.links[i])
        elif index.sparse and i in index.sparse:
            line += b"\t" + encode_map(index.sparse[i])
        elif index.packed and i in index.packed:
            codec, stored, crc = index.packed[i]
            line += b"\t@%s,%d,%d" % (codec.encode(), stored, crc)
        lines.append(line)
    body = b"\n".join(lines)
    fmt = INDEX_FORMAT_PACKED if index.packed else \
        INDEX_FORMAT_SPARSE if index.sparse else INDEX_FORMAT
    header = {
        "format": fmt,
        "size": index.size,
        "sha256": index.sha256,
        "compression": index.compression,
        "tar_size": index.tar_size,
        "members": len(index.paths),
        "body_sha256": hashlib.sha256(body).hexdigest(),
        "skipped": index.skipped,
    }
    if index.crc32c is not None:
        header["crc32c"] = index.crc32c
    if index.notes:
        header["notes"] = index.notes
    return json.dumps(header, sort_keys=True).encode() + b"\n" + body


def decode_index(data: bytes, *, expect_size: int | None = None) -> ShardIndex:
    """Parse and verify an index file; IndexFormatError if it is damaged or for another shard."""
    head, _, body = data.partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise IndexFormatError(f"index header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") not in _FORMATS:
        raise IndexFormatError(f"not a {' / '.join(_FORMATS)} index")
    has_sparse = header["format"] in (INDEX_FORMAT_SPARSE, INDEX_FORMAT_PACKED)
    has_packed = header["format"] == INDEX_FORMAT_PACKED
    if hashlib.sha256(body).hexdigest() != header.get("body_sha256"):
        raise IndexFormatError("index body checksum mismatch (damaged or truncated index)")
    size = header.get("size")
    if not isinstance(size, int) or (expect_size is not None and size != expect_size):
        raise IndexFormatError(f"index is for a shard of {size} bytes, the shard has {expect_size}")
    skipped = header.get("skipped") or {}
    if not isinstance(skipped, dict):
        raise IndexFormatError("index header field 'skipped' is not an object")
    if not has_sparse and skipped.get("sparse"):
        raise IndexFormatError("index predates sparse member support (it skipped them)")
    notes = header.get("notes") or {}
    if not isinstance(notes, dict):
        raise IndexFormatError("index header field 'notes' is not an object")
    compression, tar_size = header.get("compression"), header.get("tar_size")
    if compression not in (None, "gzip", "zstd", "lz4"):
        raise IndexFormatError(f"index names an unknown compression {compression!r}")
    if compression is not None and not (isinstance(tar_size, int) and tar_size >= 0):
        raise IndexFormatError("index of a compressed shard lacks its tar_size")
    crc32c = header.get("crc32c")
    if crc32c is not None and not valid_crc32c(crc32c):
        raise IndexFormatError(f"index header field 'crc32c' is not 8 hex digits: {crc32c!r}")
    index = ShardIndex(size=size, sha256=header.get("sha256"), crc32c=crc32c,
                       skipped=skipped, notes=notes,
                       compression=compression, tar_size=tar_size if compression else None)
    if body:
        # The checksum only proves the body is intact, not that its writer was sane: a
        # published index comes from the server, so every field is checked here.
        try:
            for pos, line in enumerate(body.split(b"\n")):
                fields = line.split(b"\t")
                if len(fields) not in (6, 7) or len(fields[0]) != 1:
                    raise IndexFormatError(f"index line {pos + 2} is malformed")
                kind = fields[0][0]
                path = _unescape(fields[5])
                if kind not in _KINDS or normalize_path(path) != path:
                    raise IndexFormatError(f"index line {pos + 2}: bad kind or unsafe path")
                if (len(fields) == 7) != (kind == KIND_LINK) and not (
                        has_sparse and kind == KIND_FILE):
                    raise IndexFormatError(f"index line {pos + 2}: link target mismatch")
                index.paths.append(path)
                index.kinds.append(kind)
                index.offsets.append(int(fields[1]))
                index.sizes.append(int(fields[2]))
                index.mtimes.append(int(fields[3]))
                index.modes.append(int(fields[4]))
                if len(fields) == 7 and kind == KIND_FILE and fields[6][:1] == b"@":
                    if not has_packed:
                        raise IndexFormatError(f"index line {pos + 2}: codec in a /1-/2 index")
                    index.packed[pos] = _decode_packed(fields[6], pos)
                elif len(fields) == 7 and kind == KIND_FILE:
                    try:
                        index.sparse[pos] = decode_map(fields[6], index.sizes[pos])
                    except ValueError as exc:
                        raise IndexFormatError(f"index line {pos + 2}: {exc}") from None
                elif len(fields) == 7:
                    target = _unescape(fields[6])
                    if not _symlink_inside(path, target):
                        raise IndexFormatError(f"index line {pos + 2}: link escapes the tree")
                    index.links[pos] = target
        except IndexFormatError:
            raise
        except (ValueError, OverflowError) as exc:
            raise IndexFormatError(f"index line {pos + 2} has a bad number: {exc}") from None
    if len(index.paths) != header.get("members"):
        raise IndexFormatError("index member count does not match its header")
    if index.data_end() > index.data_size:
        raise IndexFormatError("index names data past the end of the shard")
    return index


def _decode_packed(raw: bytes, pos: int) -> Packed:
    codec, stored, crc = raw[1:].split(b",")
    name = codec.decode("ascii", "replace")
    if name not in PACKED_CODECS:
        raise IndexFormatError(f"index line {pos + 2}: unknown codec {name!r}")
    if int(stored) < 0 or not 0 <= int(crc) < 1 << 32:
        raise IndexFormatError(f"index line {pos + 2}: bad stored size or CRC")
    return name, int(stored), int(crc)
