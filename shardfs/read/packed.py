"""Reads of compressed members (zip deflate/bzip2/lzma/zstd/xz/deflate64, split RecordIO
records): the stored bytes come through the reader as one stored member (so cached shards,
whole-shard fetches and member reads all apply), are decoded whole and checked (size, and
CRC-32 for zip), and kept decoded in a small LRU: the kernel asks for a file in pieces of
at most 128 KiB, and each piece must not decode the member again.

A member whose bytes do not decode to its declared size, or whose CRC-32 differs, is a
ReadError (EIO, logged by the FUSE layer); nothing else is affected. Decoding never makes
more than the declared size (plus one byte to notice more).

Zip members larger than WHOLE_LIMIT (stored or decoded) are not decoded whole: a stream per
member (`_Stream`) decodes forward as reads ask, keeping a window of its latest output, so
memory stays bounded whatever the size; a read before the window starts decoding again from
the beginning (sequential reads, what the kernel sends, never do). Their CRC-32 is checked
when the decoding reaches the end: that read fails with EIO on a mismatch (earlier reads of
the member have been answered by then).
"""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from collections.abc import Callable

import trio
from cachetools import LRUCache

from shardfs.catalog.recordio import join_split
from shardfs.catalog.shardindex import Packed
from shardfs.catalog.tree import FileRef
from shardfs.catalog.zip import MAX_PACKED
from shardfs.read.reader import ReadError

DECODED_CACHE = 64 << 20  # bytes of decoded members kept (per process)
WHOLE_LIMIT = 16 << 20  # larger zip members are decoded as a stream (see _Stream)
_STREAM_IN = 1 << 20  # stored bytes fetched at a time by a stream
_STREAM_OUT = 4 << 20  # decoded bytes per decoder call (bounds a bomb's output)
_STREAM_KEEP = 8 << 20  # decoded bytes a stream keeps before the latest read
_STREAMS = 4  # member streams kept per process
_THREAD_BELOW = 1 << 20  # decode smaller inputs inline; a thread hop costs ~100 us
_CRC_CODECS = frozenset(("deflate", "deflate64", "bzip2", "lzma", "zstd", "xz"))


class DecodeError(ValueError):
    """Stored bytes that do not decode to the member (corrupt, or not what the index says)."""


def _deflate(raw: bytes, size: int) -> bytes:
    d = zlib.decompressobj(-15)
    return d.decompress(raw, size + 1)


def _deflate64(raw: bytes, size: int) -> bytes:
    try:
        import inflate64
    except ImportError:
        raise DecodeError("deflate64 members need the inflate64 package "
                          "(pip install 'shardfs[compression]')") from None
    return inflate64.Inflater().inflate(raw)[: size + 1]


def _bzip2(raw: bytes, size: int) -> bytes:
    return bz2.BZ2Decompressor().decompress(raw, size + 1)


def _lzma(raw: bytes, size: int) -> bytes:
    # Zip's LZMA: version (2 bytes), properties size (2), properties (lc/lp/pb byte, dict
    # size), then a raw LZMA1 stream.
    if len(raw) < 4:
        raise DecodeError("LZMA member too short")
    props_size = struct.unpack_from("<H", raw, 2)[0]
    props = raw[4 : 4 + props_size]
    if props_size != 5 or len(props) != 5:
        raise DecodeError("LZMA member with bad properties")
    d, dict_size = props[0], struct.unpack_from("<L", props, 1)[0]
    if d >= 9 * 5 * 5:
        raise DecodeError("LZMA member with bad properties")
    lzma1 = {"id": lzma.FILTER_LZMA1, "dict_size": dict_size, "lc": d % 9,
             "lp": d // 9 % 5, "pb": d // 45}
    dec = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[lzma1])
    return dec.decompress(raw[4 + props_size :], size + 1)


def _xz(raw: bytes, size: int) -> bytes:
    return lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(raw, size + 1)


def _zstd(raw: bytes, size: int) -> bytes:
    try:
        import zstandard
    except ImportError:
        raise DecodeError("zstd members need the zstandard package "
                          "(pip install 'shardfs[compression]')") from None
    with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
        return reader.read(size + 1)


_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "deflate": _deflate, "deflate64": _deflate64, "bzip2": _bzip2, "lzma": _lzma,
    "xz": _xz, "zstd": _zstd,
}


def decode(packed: Packed, raw: bytes, size: int) -> bytes:
    """The member's bytes from its stored bytes `raw`; DecodeError if they are not it."""
    codec, _, check = packed
    if size > MAX_PACKED:
        raise DecodeError(f"compressed member of {size} bytes is over the {MAX_PACKED} limit")
    try:
        out = join_split(raw, check) if codec == "recordio" else _DECODERS[codec](raw, size)
    except DecodeError:
        raise
    except (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError, KeyError,
            RuntimeError) as exc:  # each library's own error for corrupt data
        raise DecodeError(f"corrupt {codec} data: {exc}") from None
    if len(out) != size:
        raise DecodeError(f"{codec} data decodes to {'more' if len(out) > size else len(out)} "
                          f"bytes, the member has {size}")
    if codec in _CRC_CODECS and zlib.crc32(out) != check:
        raise DecodeError(f"CRC-32 mismatch ({zlib.crc32(out):08x}, the zip says {check:08x})")
    return out


class _Incremental:
    """A zip codec's decoder fed stored bytes in order; output comes in pieces of at most
    about _STREAM_OUT bytes (max_length where the library has it, small input slices where
    it does not: a deflate64 or zstd block's output is bounded by its input)."""

    def __init__(self, codec: str) -> None:
        self.codec = codec
        self._head = b""  # zip LZMA: its 4 + 5 header bytes, until all are in
        self._slice = 4096 if codec == "deflate64" else 1024
        if codec == "deflate":
            self._d = zlib.decompressobj(-15)
        elif codec == "bzip2":
            self._d = bz2.BZ2Decompressor()
        elif codec == "xz":
            self._d = lzma.LZMADecompressor(lzma.FORMAT_XZ)
        elif codec == "lzma":
            self._d = None  # made once the header is in
        elif codec == "deflate64":
            try:
                import inflate64
            except ImportError:
                raise DecodeError("deflate64 members need the inflate64 package") from None
            self._d = inflate64.Inflater()
        elif codec == "zstd":
            try:
                import zstandard
            except ImportError:
                raise DecodeError("zstd members need the zstandard package") from None
            self._d = zstandard.ZstdDecompressor().decompressobj()
        else:
            raise DecodeError(f"no stream decoder for {codec}")

    def push(self, data: bytes, sink: Callable[[bytes], None]) -> None:
        codec, d = self.codec, self._d
        if codec == "lzma" and d is None:
            self._head += data
            if len(self._head) < 9:
                return
            props = self._head[4:9]
            first = props[0]
            if struct.unpack_from("<H", self._head, 2)[0] != 5 or first >= 225:
                raise DecodeError("LZMA member with bad properties")
            lzma1 = {"id": lzma.FILTER_LZMA1, "dict_size": struct.unpack_from("<L", props, 1)[0],
                     "lc": first % 9, "lp": first // 9 % 5, "pb": first // 45}
            d = self._d = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[lzma1])
            data = self._head[9:]
        if codec == "deflate":
            while data:
                sink(d.decompress(data, _STREAM_OUT))
                data = d.unconsumed_tail
        elif codec in ("bzip2", "xz", "lzma"):
            if d.eof:
                return
            sink(d.decompress(data, _STREAM_OUT))
            while not d.eof and not d.needs_input:
                sink(d.decompress(b"", _STREAM_OUT))
        else:  # deflate64, zstd: no output bound, so small input slices
            for at in range(0, len(data), self._slice):
                piece = data[at : at + self._slice]
                sink(d.inflate(piece) if codec == "deflate64" else d.decompress(piece))


class _Stream:
    """One large zip member decoded forward (see the module docstring)."""

    def __init__(self, packed: Packed) -> None:
        self.lock = trio.Lock()
        self.packed = packed
        self._reset()

    def _reset(self) -> None:
        self.decoder = _Incremental(self.packed[0])
        self.stored_pos = 0  # stored bytes fed so far
        self.pos = 0  # decoded bytes made so far
        self.crc = 0
        self.buf = bytearray()  # decoded bytes [pos - len(buf), pos)

    async def read(self, reader, ref: FileRef, off: int, size: int) -> bytes:
        end = min(off + size, ref.size)
        if off < self.pos - len(self.buf):
            self._reset()  # before the window: decode from the beginning again
        stored = self.packed[1]
        while self.pos < end:
            if self.stored_pos >= stored:
                raise DecodeError(f"{self.packed[0]} data ends after {self.pos} bytes, the "
                                  f"member has {ref.size}")
            n = min(_STREAM_IN, stored - self.stored_pos)
            data = bytes(await reader.read(ref.shard, ref.offset, stored, self.stored_pos, n))
            self.stored_pos += len(data)
            pieces: list[bytes] = []
            try:
                await trio.to_thread.run_sync(self.decoder.push, data, pieces.append)
            except DecodeError:
                raise
            except Exception as exc:  # each library's own error for corrupt data
                raise DecodeError(f"corrupt {self.packed[0]} data: {exc}") from None
            for piece in pieces:
                if self.pos + len(piece) > ref.size:
                    raise DecodeError(f"{self.packed[0]} data decodes to more than the "
                                      f"member's {ref.size} bytes")
                self.crc = zlib.crc32(piece, self.crc)
                self.pos += len(piece)
                self.buf += piece
            keep_from = min(off, self.pos) - _STREAM_KEEP
            drop = keep_from - (self.pos - len(self.buf))
            if drop > 0:
                del self.buf[:drop]
        if self.pos == ref.size and self.crc != self.packed[2]:
            raise DecodeError(f"CRC-32 mismatch ({self.crc:08x}, the zip says "
                              f"{self.packed[2]:08x})")
        start = self.pos - len(self.buf)
        return bytes(self.buf[off - start : end - start])


class PackedReads:
    """Decoded compressed members of one process, shared by its concurrent reads."""

    def __init__(self, cache_bytes: int = DECODED_CACHE) -> None:
        self._decoded: LRUCache = LRUCache(maxsize=cache_bytes, getsizeof=len)
        self._last: tuple[tuple[int, int], bytes] | None = None  # one too large for the LRU
        self._inflight: dict[tuple[int, int], trio.Event] = {}
        self._failed: dict[tuple[int, int], str] = {}  # outcome for the reads that waited
        self._streams: LRUCache = LRUCache(maxsize=_STREAMS)  # large members being read
        self.decoded = 0  # members decoded (a test reads it)

    async def read(self, reader, ref: FileRef, packed: Packed, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of the member (clipped to its end); ReadError -> EIO."""
        if off >= ref.size or size <= 0:
            return b""
        if packed[0] != "recordio" and max(packed[1], ref.size) > WHOLE_LIMIT:
            return await self._streamed(reader, ref, packed, off, size)
        data = await self._member(reader, ref, packed)
        return data[off : off + size]

    async def _streamed(self, reader, ref: FileRef, packed: Packed, off: int,
                        size: int) -> bytes:
        key = (ref.shard, ref.offset)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream(packed)
        async with stream.lock:  # the kernel's concurrent pieces of one file, in turn
            try:
                return await stream.read(reader, ref, off, size)
            except DecodeError as exc:
                self._streams.pop(key, None)  # the next read starts afresh
                raise ReadError(str(exc)) from None
            except ReadError:
                self._streams.pop(key, None)
                raise

    def _get(self, key: tuple[int, int]) -> bytes | None:
        data = self._decoded.get(key)
        if data is None and self._last is not None and self._last[0] == key:
            data = self._last[1]
        return data

    async def _member(self, reader, ref: FileRef, packed: Packed) -> bytes:
        key = (ref.shard, ref.offset)
        while True:
            data = self._get(key)
            if data is not None:
                return data
            event = self._inflight.get(key)
            if event is None:
                break
            await event.wait()  # another read decodes it: take its outcome
            if key in self._failed:
                raise ReadError(self._failed[key])
        event = self._inflight[key] = trio.Event()
        self._failed.pop(key, None)
        try:
            stored = packed[1]
            if max(stored, ref.size) > MAX_PACKED:  # a published index may say anything
                raise ReadError(f"compressed member of {max(stored, ref.size)} bytes is over "
                                f"the {MAX_PACKED} limit")
            raw = bytes(await reader.read(ref.shard, ref.offset, stored, 0, stored))
            try:
                if len(raw) < _THREAD_BELOW:
                    data = decode(packed, raw, ref.size)
                else:
                    data = await trio.to_thread.run_sync(decode, packed, raw, ref.size)
            except DecodeError as exc:
                self._failed[key] = str(exc)
                raise ReadError(str(exc)) from None
            self.decoded += 1
            if len(data) <= self._decoded.maxsize:
                self._decoded[key] = data
            else:
                self._last = (key, data)
            return data
        except ReadError as exc:
            self._failed[key] = str(exc)
            raise
        finally:
            del self._inflight[key]
            event.set()
