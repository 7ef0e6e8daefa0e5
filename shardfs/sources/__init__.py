"""Shard sources: where shard bytes come from (HTTP(S) servers, S3, AIStore, local files)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from shardfs.sources.ais import AisSource
from shardfs.sources.base import (
    NotFound,
    RangeNotSupported,
    ShardChanged,
    ShardInfo,
    Source,
    SourceError,
    SourceSettings,
    SourceStats,
    Unreachable,
    check_span,
)
from shardfs.sources.file import FileSource
from shardfs.sources.http import HttpSource
from shardfs.sources.s3 import Listing, S3Source

__all__ = [
    "AisSource",
    "FileSource",
    "HttpSource",
    "Listing",
    "NotFound",
    "RangeNotSupported",
    "S3Source",
    "ShardChanged",
    "ShardInfo",
    "Source",
    "SourceError",
    "SourceSettings",
    "SourceStats",
    "Sources",
    "Unreachable",
    "check_span",
    "to_url",
]

SUPPORTED = "http://, https://, s3://, ais://, file:// (or a local path)"
_HAS_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def to_url(spec: str) -> str:
    """A shard given by the user as a URL or a local path -> a URL.

    Anything of the form `scheme://...` is kept as is (an unsupported scheme is reported by
    Sources.for_url); everything else is a path, made absolute and percent-quoted."""
    if _HAS_SCHEME.match(spec):
        return spec
    return Path(os.path.abspath(os.path.expanduser(spec))).as_uri()


class Sources:
    """One source per kind, created on first use and shared by all shards."""

    def __init__(self, settings: SourceSettings | None = None, *,
                 after: Sources | None = None) -> None:
        """`after`: the closed Sources of an earlier event loop of this daemon (indexing runs
        in a loop of its own): its counters carry on here, and servers that answered it are
        not "first contact" any more."""
        self.settings = settings or SourceSettings()
        self._http: HttpSource | None = None
        self._file: FileSource | None = None
        self._s3: S3Source | None = None
        self._ais: AisSource | None = None
        self._earlier = after.stats() if after is not None else SourceStats()
        self._answered = after.answered() if after is not None else set()
        self._closed: list[Source] = []  # sources closed by aclose(): their counters remain

    def for_url(self, url: str) -> Source:
        scheme = urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            if self._http is None:
                self._http = HttpSource(self.settings)
                self._http.answered |= self._answered
            return self._http
        if scheme == "file":
            if self._file is None:
                self._file = FileSource(self.settings)
            return self._file
        if scheme == "s3":
            if self._s3 is None:
                self._s3 = S3Source(self.settings)  # reads AWS env/config: may raise
            return self._s3
        if scheme == "ais":
            if self._ais is None:
                self._ais = AisSource(self.settings)
            return self._ais
        named = f"scheme {scheme!r}" if scheme else "no scheme"
        raise SourceError(f"{url}: unsupported URL ({named}); supported: {SUPPORTED}")

    def stats(self) -> SourceStats:
        """Counters of all sources, summed."""
        total = SourceStats()
        for s in [self._earlier] + [source.stats for source in self._open() + self._closed]:
            total.requests += s.requests
            total.bytes_received += s.bytes_received
            total.retries += s.retries
            total.errors += s.errors
            for status, count in s.by_status.items():
                total.by_status[status] = total.by_status.get(status, 0) + count
        return total

    def _open(self) -> list[Source]:
        return [s for s in (self._http, self._file, self._s3, self._ais) if s is not None]

    def answered(self) -> set[str]:
        """Servers (scheme://host:port) that have answered a request."""
        return self._answered.union(*(getattr(s, "answered", set())
                                      for s in self._open() + self._closed))

    async def aclose(self) -> None:
        opened = self._open()
        self._http = self._file = self._s3 = self._ais = None
        for source in opened:
            self._closed.append(source)
            await source.aclose()
