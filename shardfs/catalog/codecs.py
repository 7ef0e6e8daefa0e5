"""Compressed shards (.tar.gz/.tgz, .tar.zst, .tar.lz4): streaming decompression.

A compressed shard cannot be read at an offset without decompressing everything before it,
so such shards are always fetched whole and decompressed into the cache; members are then
served from the plain tar bytes there. Indexing them necessarily streams them once.
"""

from __future__ import annotations

import zlib
from typing import Protocol

_SUFFIXES = ((".tar.gz", "gzip"), (".tgz", "gzip"), (".tar.zst", "zstd"),
             (".tar.zstd", "zstd"), (".tar.lz4", "lz4"))


class CodecError(ValueError):
    """Corrupt compressed data, or a codec whose library is not installed."""


def codec_for(url: str) -> str | None:
    """The compression of a shard, from its name; None for a plain tar."""
    path = url.split("?", 1)[0].lower()
    for suffix, codec in _SUFFIXES:
        if path.endswith(suffix):
            return codec
    return None


class Decompressor(Protocol):
    def feed(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes:
        """Remaining output; CodecError if the compressed stream was cut short."""
        ...


class _Frames:
    """Formats made of self-delimiting members/frames, possibly several concatenated
    (as pigz or `cat a.gz b.gz` make): a new decompressor starts after each one ends."""

    error: type[Exception] = Exception
    name = ""

    def _new(self):  # -> a fresh zlib/lz4 decompressor object
        raise NotImplementedError

    def __init__(self) -> None:
        self._d = self._new()
        self._in_member = False

    def feed(self, data: bytes) -> bytes:
        out = []
        try:
            while data:
                self._in_member = True
                out.append(self._d.decompress(data))
                if not self._d.eof:
                    break
                self._in_member = False
                data = self._d.unused_data
                self._d = self._new()
        except self.error as exc:
            raise CodecError(f"corrupt {self.name} data: {exc}") from None
        return b"".join(out)

    def finish(self) -> bytes:
        if self._in_member:
            raise CodecError(f"{self.name} stream is truncated")
        return b""


class _Gzip(_Frames):
    error = zlib.error
    name = "gzip"

    def _new(self):
        return zlib.decompressobj(wbits=31)


class _Zstd(_Frames):
    name = "zstd"

    def _new(self):
        try:
            import zstandard
        except ImportError:
            raise CodecError("zstd shards need the zstandard package "
                             "(pip install 'shardfs[compression]')") from None
        self.error = zstandard.ZstdError
        return zstandard.ZstdDecompressor().decompressobj()


class _Lz4(_Frames):
    error = RuntimeError
    name = "lz4"

    def _new(self):
        try:
            import lz4.frame
        except ImportError:
            raise CodecError("lz4 shards need the lz4 package "
                             "(pip install 'shardfs[compression]')") from None
        return lz4.frame.LZ4FrameDecompressor()


def decompressor(codec: str) -> Decompressor:
    if codec == "gzip":
        return _Gzip()
    if codec == "zstd":
        return _Zstd()
    if codec == "lz4":
        return _Lz4()
    raise CodecError(f"unknown compression {codec!r}")
