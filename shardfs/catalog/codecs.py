"""Compressed shards (.tar.gz/.tgz, .tar.zst, .tar.lz4): streaming decompression.

A compressed shard cannot be read at an offset without decompressing everything before it,
so such shards are always fetched whole and decompressed into the cache; members are then
served from the plain tar bytes there. Indexing them necessarily streams them once.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Protocol

from shardfs.util.urls import path_of

_SUFFIXES = ((".tar.gz", "gzip"), (".tgz", "gzip"), (".tar.zst", "zstd"),
             (".tar.zstd", "zstd"), (".tar.lz4", "lz4"))


class CodecError(ValueError):
    """Corrupt compressed data, or a codec whose library is not installed."""


def codec_for(url: str) -> str | None:
    """The compression of a shard, from its name; None for a plain tar."""
    path = path_of(url).lower()  # an http(s) query is not part of the name
    for suffix, codec in _SUFFIXES:
        if path.endswith(suffix):
            return codec
    return None


class Decompressor(Protocol):
    trailing_garbage: int  # bytes after the last member/frame that start no new one

    def feed(self, data: bytes) -> bytes:
        """All the output of `data` at once (its size is not bounded: see feed_into)."""
        ...

    def feed_into(self, data: bytes, sink: Callable[[bytes], object]) -> None:
        """The output of `data`, handed to `sink` in pieces of bounded size (about 128 MiB
        at most, usually far less), so that a small input of a huge run of zeros (a
        compression bomb, or just an 8 GB sparse file in a tar.zst) never sits in memory."""
        ...

    def finish(self) -> bytes:
        """Remaining output; CodecError if the compressed stream was cut short."""
        ...


_LOOK = 8  # bytes enough to recognise the start of a member/frame
_OUT = 16 << 20  # output per call where the library can bound it (zlib)
# Input per call where it cannot: a zstd block is at least 4 bytes in, at most 128 KiB out,
# so 4 KiB in gives at most 128 MiB out; lz4 blocks give at most 4 MiB (8 MiB legacy).
_SLICE = 4096


class _Frames:
    """Formats made of self-delimiting members/frames, possibly several concatenated
    (as pigz or `cat a.gz b.gz` make): a new decompressor starts after each one ends.

    Bytes after a complete member that do not start another one are trailing garbage:
    ignored and counted, as gzip ("decompression OK, trailing garbage ignored"), GNU tar and
    libarchive do. The tar inside is whole or not on its own: the tar parser still reports
    a truncated archive."""

    error: type[Exception] | tuple[type[Exception], ...] = Exception
    name = ""

    def _new(self, head: bytes):  # -> a fresh decompressor object for a frame starting so
        raise NotImplementedError

    @staticmethod
    def _starts_frame(head: bytes) -> bool | None:
        """Whether `head` starts a member/frame; None if it is too short to tell."""
        raise NotImplementedError

    def __init__(self) -> None:
        self._d = None  # decompressor of the member in progress; None between members
        self._head = b""  # first bytes of the next member, while too few to recognise it
        self._members = 0  # complete members so far
        self.trailing_garbage = 0

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        self.feed_into(data, out.append)
        return b"".join(out)

    def _decompress(self, d, data: bytes, sink: Callable[[bytes], object]) -> bytes | None:
        """Feed `data` to the member's decompressor `d`; the bytes after the member if it
        ended in them, else None. Input goes in slices, to bound each call's output."""
        view = memoryview(data)
        for start in range(0, len(view), _SLICE):
            piece = d.decompress(bytes(view[start : start + _SLICE]))
            if piece:
                sink(piece)
            if d.eof:
                return (d.unused_data or b"") + bytes(view[start + _SLICE :])
        return None

    def feed_into(self, data: bytes, sink: Callable[[bytes], object]) -> None:
        if self.trailing_garbage:
            self.trailing_garbage += len(data)
            return
        try:
            while data:
                if self._d is None:
                    head = self._head + bytes(data[: _LOOK - len(self._head)])
                    starts = self._starts_frame(head)
                    if starts is None and len(head) < _LOOK:
                        self._head = head  # all of `data` went into it
                        break
                    data = self._head + data
                    self._head = b""
                    if not starts and self._members:
                        self.trailing_garbage = len(data)
                        break
                    self._d = self._new(head)  # a first member that is none fails in it
                rest = self._decompress(self._d, data, sink)
                if rest is None:
                    break
                self._members += 1
                data = rest
                self._d = None
        except self.error as exc:
            raise CodecError(f"corrupt {self.name} data: {exc}") from None

    def finish(self) -> bytes:
        if self._d is not None and not getattr(self._d, "complete", False):
            raise CodecError(f"{self.name} stream is truncated")
        if self._head:
            if not self._members:
                raise CodecError(f"{self.name} stream is truncated")
            self.trailing_garbage += len(self._head)
        return b""


class _Gzip(_Frames):
    error = zlib.error
    name = "gzip"

    def _new(self, head: bytes):
        return zlib.decompressobj(wbits=31)

    def _decompress(self, d, data: bytes, sink: Callable[[bytes], object]) -> bytes | None:
        while True:  # zlib bounds its output itself
            piece = d.decompress(data, _OUT)
            if piece:
                sink(piece)
            if d.eof:
                return d.unused_data
            data = d.unconsumed_tail
            if not data and len(piece) < _OUT:
                return None

    @staticmethod
    def _starts_frame(head: bytes) -> bool | None:
        return None if len(head) < 2 and b"\x1f\x8b".startswith(head) \
            else head.startswith(b"\x1f\x8b")


def _zstd_like_magic(head: bytes, magics: tuple[bytes, ...]) -> bool | None:
    """`head` starts one of `magics` or a skippable frame (0x184D2A5?, little-endian)."""
    if len(head) < 4:
        partial = any(m.startswith(head) for m in magics) or (
            not head or (head[0] & 0xF0 == 0x50 and b"\x2a\x4d\x18".startswith(head[1:])))
        return None if partial else False
    return head[:4] in magics or (head[0] & 0xF0 == 0x50 and head[1:4] == b"\x2a\x4d\x18")


class _Zstd(_Frames):
    name = "zstd"

    def _new(self, head: bytes):
        try:
            import zstandard
        except ImportError:
            raise CodecError("zstd shards need the zstandard package "
                             "(pip install 'shardfs[compression]')") from None
        self.error = zstandard.ZstdError
        return zstandard.ZstdDecompressor().decompressobj()

    @staticmethod
    def _starts_frame(head: bytes) -> bool | None:
        return _zstd_like_magic(head, (b"\x28\xb5\x2f\xfd",))


_LZ4_FRAME = b"\x04\x22\x4d\x18"
_LZ4_LEGACY = b"\x02\x21\x4c\x18"


class _Lz4Legacy:
    """lz4's legacy format (`lz4 -l`, older lz4 tools): the magic, then blocks of a 4-byte
    little-endian compressed size and the data, each at most 8 MiB decompressed; it ends at
    the end of the input or where another frame's magic stands in place of a size."""

    _BLOCK = 8 << 20
    _MAX_COMPRESSED = _BLOCK + _BLOCK // 255 + 16  # LZ4_compressBound(8 MiB)

    def __init__(self) -> None:
        import lz4.block

        self._block = lz4.block
        self._buf = bytearray()
        self._started = False
        self.eof = False
        self.unused_data = b""

    @property
    def complete(self) -> bool:
        """No block is cut short: the input may end here."""
        return self._started and not self._buf

    def decompress(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        if not self._started:
            if len(self._buf) < 4:
                return b""
            del self._buf[:4]  # the magic (checked by the caller)
            self._started = True
        while len(self._buf) >= 4:
            word = bytes(self._buf[:4])
            if _Lz4._starts_frame(word):
                self.eof, self.unused_data = True, bytes(self._buf)
                self._buf.clear()
                break
            size = int.from_bytes(word, "little")
            if size > self._MAX_COMPRESSED:
                raise RuntimeError(f"legacy block of {size} bytes")
            if len(self._buf) < 4 + size:
                break
            out.append(self._block.decompress(bytes(self._buf[4 : 4 + size]),
                                              uncompressed_size=self._BLOCK))
            del self._buf[: 4 + size]
        return b"".join(out)


class _Lz4(_Frames):
    error = RuntimeError
    name = "lz4"

    def _new(self, head: bytes):
        try:
            import lz4.block
            import lz4.frame
        except ImportError:
            raise CodecError("lz4 shards need the lz4 package "
                             "(pip install 'shardfs[compression]')") from None
        self.error = (RuntimeError, lz4.block.LZ4BlockError)
        if head.startswith(_LZ4_LEGACY):
            return _Lz4Legacy()
        return lz4.frame.LZ4FrameDecompressor()

    @staticmethod
    def _starts_frame(head: bytes) -> bool | None:
        return _zstd_like_magic(head, (_LZ4_FRAME, _LZ4_LEGACY))


def decompressor(codec: str) -> Decompressor:
    if codec == "gzip":
        return _Gzip()
    if codec == "zstd":
        return _Zstd()
    if codec == "lz4":
        return _Lz4()
    raise CodecError(f"unknown compression {codec!r}")
