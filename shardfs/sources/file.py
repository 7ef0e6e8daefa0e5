"""Shards on a local (or locally mounted) filesystem, addressed by file:// URLs.

All file I/O runs in worker threads so a slow disk or network filesystem never blocks trio."""

from __future__ import annotations

import os
import stat as stat_mod
from collections.abc import AsyncIterator, Callable
from typing import TypeVar, TypeVarTuple
from urllib.parse import unquote_to_bytes, urlsplit

import trio

from shardfs.sources.base import (
    NotFound,
    ShardChanged,
    ShardInfo,
    SourceError,
    SourceSettings,
    SourceStats,
    check_span,
)
from shardfs.util.fileio import pwrite_all

Ts = TypeVarTuple("Ts")
R = TypeVar("R")


def file_path(url: str) -> str:
    """The local path named by a file:// URL (percent-decoded, bytes-exact)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "file":
        raise SourceError(f"{url}: not a file:// URL")
    if parts.netloc not in ("", "localhost"):
        raise SourceError(f"{url}: file URLs must name a local path (file:///path)")
    path = os.fsdecode(unquote_to_bytes(parts.path))
    if not path.startswith("/"):
        raise SourceError(f"{url}: file URLs need an absolute path")
    return path


def file_etag(st: os.stat_result) -> str:
    """Changes whenever the file is replaced or rewritten (new inode, mtime or size)."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _open_regular(path: str, url: str) -> tuple[int, os.stat_result]:
    """Open a regular file for reading; the caller owns the fd. Runs in a worker thread."""
    try:
        # O_NONBLOCK: opening a FIFO by mistake must not hang; no effect on regular files.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise NotFound(f"{url}: no such file") from e
    except OSError as e:
        raise SourceError(f"{url}: cannot open: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if stat_mod.S_ISDIR(st.st_mode):
            raise SourceError(f"{url}: is a directory, not a shard")
        if not stat_mod.S_ISREG(st.st_mode):
            raise SourceError(f"{url}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _stat(path: str, url: str) -> os.stat_result:
    fd, st = _open_regular(path, url)  # opening proves it is readable
    os.close(fd)
    return st


def _read_whole(path: str, url: str, limit: int) -> bytes | None:
    try:
        fd, st = _open_regular(path, url)
    except NotFound:
        return None
    try:
        if st.st_size > limit:
            raise SourceError(f"{url}: larger than {limit} bytes, refusing to load it whole")
        parts: list[bytes] = []
        while data := os.read(fd, 1 << 20):
            parts.append(data)
        return b"".join(parts)
    finally:
        os.close(fd)


def _pread(fd: int, size: int, offset: int, url: str) -> bytes:
    try:
        return os.pread(fd, size, offset)
    except OSError as e:
        raise SourceError(f"{url}: read failed at byte {offset}: {e.strerror}") from e


def _pread_into(fd: int, size: int, offset: int, url: str, into: int | None) -> bytes:
    """_pread, and the bytes written at the same offset into `into` if given (OSError: not
    written)."""
    data = _pread(fd, size, offset, url)
    if data and into is not None:
        pwrite_all(into, data, offset)
    return data


class FileSource:
    """Shards in local files."""

    def __init__(self, settings: SourceSettings | None = None) -> None:
        self.settings = settings or SourceSettings()
        self.stats = SourceStats()

    async def stat(self, url: str) -> ShardInfo:
        path = file_path(url)
        self.stats.requests += 1
        st = await self._in_thread(_stat, path, url)
        return ShardInfo(url=url, size=st.st_size, etag=file_etag(st))

    async def stream(self, shard: ShardInfo, start: int, end: int) -> AsyncIterator[bytes]:
        async for data in self._stream(shard, start, end, None):
            yield data

    async def stream_into(self, shard: ShardInfo, start: int, end: int,
                          into: int) -> AsyncIterator[bytes]:
        """As `stream`, each piece also written at its offset in the shard into the file
        `into` (the reader's cache file) by the thread that read it, before it is yielded:
        a 1 MiB write costs ~0.22 ms that the event loop's thread no longer spends (issue
        26). An OSError of the write (a full disk) is raised as the caller's own would be."""
        async for data in self._stream(shard, start, end, into):
            yield data

    async def _stream(self, shard: ShardInfo, start: int, end: int,
                      into: int | None) -> AsyncIterator[bytes]:
        check_span(shard, start, end)
        if start == end:
            return
        path = file_path(shard.url)
        self.stats.requests += 1
        fd, st = await self._in_thread(_open_regular, path, shard.url)
        try:
            if st.st_size != shard.size or (shard.etag and file_etag(st) != shard.etag):
                self.stats.errors += 1
                raise ShardChanged(
                    f"{shard.url}: file changed since mount time "
                    f"(size {st.st_size}, was {shard.size})"
                )
            pos = start
            while pos < end:
                size = min(self.settings.chunk_size, end - pos)
                data = await self._in_thread(_pread_into, fd, size, pos, shard.url, into)
                if not data:
                    self.stats.errors += 1
                    raise ShardChanged(f"{shard.url}: file shrank while reading (EOF at {pos})")
                self.stats.bytes_received += len(data)
                pos += len(data)
                yield data
        finally:
            os.close(fd)  # closing a read-only regular file does no I/O worth a thread

    async def fetch_optional(self, url: str) -> bytes | None:
        path = file_path(url)
        self.stats.requests += 1
        data = await self._in_thread(_read_whole, path, url, self.settings.max_fetch_bytes)
        if data is not None:
            self.stats.bytes_received += len(data)
        return data

    async def aclose(self) -> None:
        pass

    async def _in_thread(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        try:
            return await trio.to_thread.run_sync(fn, *args, thread_name="shardfs file")
        except SourceError:
            self.stats.errors += 1
            raise
