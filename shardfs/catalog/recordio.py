"""Pure parsing of MXNet indexed RecordIO (`.rec` + `.idx`) into shard members (no I/O).

The format (dmlc-core recordio, mxnet.recordio): a record is one or more chunks, each an
8-byte header — the magic 0xced7230a and a word of 3-bit cflag and 29-bit length, both
little-endian — and `length` bytes padded to 4. cflag 0 is a whole record; a writer that
meets the magic at a 4-aligned place in the data splits the record there: chunks flagged
1 (first), 2 (middle), 3 (last), and a reader puts the magic back between them. mxnet's
image records start with an IRHeader `<IfQQ` (flag, label, id, id2); flag > 0 means `flag`
float32 labels follow it (and `label` is unused); the image bytes come after. The `.idx` is
text: `key<TAB>offset` per line, the offset of the record's first chunk header.

Members are the image payloads, header stripped, named `<label>/<key>.<ext>` (ImageFolder's
layout): the label zero-padded to the widest integral label of the file, so that sorted
class names give class index == label; `ext` from the payload's magic bytes. Records with
flag > 0 take their first label as the class (as insightface's loader does); records with
no image bytes after their header (insightface's header record 0 and its identity-range
records) are skipped as "recordio-no-image". A whole record is a plain byte range; a split
one is a compressed member of codec "recordio" (shardfs/read/packed.py joins its chunks),
whose stored range spans its chunks and whose check field is the header length to drop.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardfs.catalog.tar import Member, normalize_path
from shardfs.util.urls import beside, replace_suffix

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)
_CHUNK = struct.Struct("<II")
_IRHEADER = struct.Struct("<IfQQ")
CHUNK_HEADER = _CHUNK.size  # 8
HEAD = 256  # payload bytes read per record: IRHeader, up to 50 labels, the image's magic
_MAX_LABELS = 1 << 16
IDX_SUFFIX = ".idx"


class RecordIOError(ValueError):
    """Not RecordIO, or an index that does not match the file; the message says why."""


@dataclass(frozen=True, slots=True)
class Chunk:
    at: int  # offset of its 8-byte header
    cflag: int
    length: int

    @property
    def next(self) -> int:
        """Where the next chunk's header is (data padded to 4 bytes)."""
        return self.at + CHUNK_HEADER + (self.length + 3) // 4 * 4


def chunk_at(header: bytes, at: int) -> Chunk:
    """The chunk whose 8 header bytes are `header` (read at `at`)."""
    if len(header) < CHUNK_HEADER:
        raise RecordIOError(f"record header cut short at byte {at}")
    magic, word = _CHUNK.unpack_from(header)
    if magic != MAGIC:
        raise RecordIOError(f"no RecordIO record at byte {at} (bad magic)")
    return Chunk(at, word >> 29, word & ((1 << 29) - 1))


def rec_url_of(idx_url: str) -> str | None:
    """`x.idx` -> `x.rec`; None if the name is not an .idx (an http(s) query is kept)."""
    return replace_suffix(idx_url, IDX_SUFFIX, ".rec")


def idx_url_of(rec_url: str) -> str:
    return replace_suffix(rec_url, ".rec", IDX_SUFFIX) or beside(rec_url, IDX_SUFFIX)


def parse_idx(text: bytes) -> list[tuple[bytes, int]]:
    """(key, offset) of each line of an .idx file, in file order."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, offset = line.strip().partition(b"\t")
        if not sep:
            key, sep, offset = line.strip().partition(b" ")
        if not sep or not offset.strip().isdigit():
            raise RecordIOError(f".idx line {n} is not `key<TAB>offset`")
        out.append((key.strip(), int(offset)))
    return out


@dataclass(slots=True)
class Record:
    key: bytes
    chunks: list[Chunk]
    head: bytes  # the first bytes of the record's first chunk (up to HEAD)


def payload_size(chunks: list[Chunk]) -> int:
    return sum(c.length for c in chunks) + len(MAGIC_BYTES) * (len(chunks) - 1)


def join_split(raw: bytes, strip: int) -> bytes:
    """The payload of a split record from its stored bytes (first chunk header to the end of
    the last chunk's data), the magic put back between chunks, its first `strip` bytes
    (the IRHeader and labels) dropped."""
    parts = []
    pos = 0
    while True:
        c = chunk_at(raw[pos : pos + CHUNK_HEADER], pos)
        data = raw[pos + CHUNK_HEADER : pos + CHUNK_HEADER + c.length]
        if len(data) != c.length:
            raise RecordIOError("split record cut short")
        parts.append(data)
        if c.cflag in (0, 3):
            break
        pos = c.next
    return MAGIC_BYTES.join(parts)[strip:]


_IMAGE_MAGIC = (
    (b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"GIF8", "gif"),
    (b"BM", "bmp"), (b"II*\x00", "tif"), (b"MM\x00*", "tif"), (b"\x93NUMPY", "npy"),
)


def extension(head: bytes) -> str:
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _IMAGE_MAGIC:
        if head.startswith(magic):
            return ext
    return "bin"


@dataclass(slots=True)
class _Image:
    key: bytes
    label: float
    ext: str
    offset: int
    size: int
    packed: tuple[str, int, int] | None


@dataclass(slots=True)
class Listing:
    members: list[Member] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)


def _image(record: Record) -> _Image | str:
    """The image of a record, or the reason it has none."""
    chunks, head = record.chunks, record.head
    if len(head) < _IRHEADER.size:
        return "recordio-no-header"
    flag, label, _, _ = _IRHEADER.unpack_from(head)
    if flag > _MAX_LABELS:
        return "recordio-bad-header"
    strip = _IRHEADER.size + 4 * flag
    if flag:
        if len(head) < strip:
            return "recordio-bad-header"
        label = struct.unpack_from("<f", head, _IRHEADER.size)[0]
    total = payload_size(chunks)
    if total <= strip:
        return "recordio-no-image"
    first = chunks[0]
    if len(chunks) == 1:
        return _Image(record.key, label, extension(head[strip:]),
                      first.at + CHUNK_HEADER + strip, total - strip, None)
    if first.length < strip:  # the split fell inside the header: keep the rule simple
        return "recordio-bad-header"
    last = chunks[-1]
    stored = last.at + CHUNK_HEADER + last.length - first.at
    return _Image(record.key, label, extension(head[strip:]), first.at, total - strip,
                  ("recordio", stored, strip))


def _class_name(label: float, width: int) -> bytes:
    if label >= 0 and label == int(label):
        return b"%0*d" % (width, int(label))
    return (b"%g" % label).replace(b"/", b"_")


def members(records: Iterable[Record], mtime: int = 0) -> Listing:
    """ImageFolder members of the records (see the module docstring)."""
    out = Listing()
    images = []
    for record in records:
        image = _image(record)
        if isinstance(image, str):
            out.skipped[image] += 1
        else:
            images.append(image)
    integral = [int(i.label) for i in images if i.label >= 0 and i.label == int(i.label)]
    width = len(str(max(integral))) if integral else 1
    for image in images:
        path = normalize_path(_class_name(image.label, width) + b"/" + image.key + b"."
                              + image.ext.encode())
        if path is None:
            out.skipped["unsafe-name"] += 1
            continue
        out.members.append(Member(path, "f", image.offset, image.size, mtime, 0o644, b"",
                                  None, image.packed))
    return out


class RecordScanner:
    """Records of a .rec fed in order, in chunks of any size (the scan without an .idx):
    keys are record numbers from 0, as im2rec numbers them."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._pos = 0  # file offset of the next byte fed
        self._buf = bytearray()  # a chunk header being collected
        self._skip = 0  # data (and padding) bytes still to pass
        self._want = 0  # of those, head bytes of the record's payload still to keep
        self._chunks: list[Chunk] = []
        self._head = bytearray()

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._skip:
                n = min(self._skip, len(view))
                if self._want:
                    keep = min(self._want, n)
                    self._head += view[:keep]
                    self._want -= keep
                self._skip -= n
                self._pos += n
                view = view[n:]
                if not self._skip and self._chunks and self._chunks[-1].cflag in (0, 3):
                    self._end_record()
                continue
            need = CHUNK_HEADER - len(self._buf)
            self._buf += view[:need]
            view = view[need:]
            if len(self._buf) < CHUNK_HEADER:
                break
            at = self._pos
            self._pos += CHUNK_HEADER
            c = chunk_at(bytes(self._buf), at)
            self._buf.clear()
            if (c.cflag in (0, 1)) == bool(self._chunks):
                raise RecordIOError(f"record chunk out of order at byte {at}")
            self._chunks.append(c)
            self._skip = c.next - self._pos
            # The head comes from the first chunk only, as when records are read by the .idx.
            self._want = min(HEAD, c.length) if self._chunks[0] is c else 0
            if not self._skip and c.cflag in (0, 3):
                self._end_record()

    def _end_record(self) -> None:
        self.records.append(Record(b"%d" % len(self.records), self._chunks,
                                   bytes(self._head)))
        self._chunks, self._head = [], bytearray()

    def finish(self) -> None:
        if self._buf or self._chunks or self._skip:
            raise RecordIOError(f"record cut short at the end of the file (byte {self._pos})")
