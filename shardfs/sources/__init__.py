"""Shard sources: where shard bytes come from (HTTP(S) servers, S3, AIStore, local files)."""

from __future__ import annotations

import os
import re
from dataclasses import fields
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
    Written,
    check_span,
)
from shardfs.sources.budget import RequestBudget
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
    "RequestBudget",
    "S3Source",
    "ShardChanged",
    "ShardInfo",
    "Source",
    "SourceError",
    "SourceSettings",
    "SourceStats",
    "Sources",
    "Unreachable",
    "Written",
    "check_span",
    "to_url",
]

SUPPORTED = "http://, https://, s3://, ais://, gs://, hf://, file:// (or a local path)"
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
        self._by_kind: dict[str, Source] = {}
        self._earlier = after.stats() if after is not None else SourceStats()
        # Sources closed by aclose(), by kind: their counters remain, and a new source of the
        # same kind takes over what they learned (servers that answered, credentials).
        self._closed: dict[str, Source] = {}
        self._before: dict[str, Source] = dict(after._closed) if after is not None else {}
        # One request budget for the whole mount, shared by every kind of source.
        self.budget = RequestBudget(self.settings.request_rate, self.settings.request_burst)

    @staticmethod
    def is_local(url: str) -> bool:
        """A shard in a file (local disk, a parallel filesystem): reading it again costs
        what reading back bytes already fetched would."""
        return urlsplit(url).scheme.lower() == "file"

    def for_url(self, url: str) -> Source:
        scheme = urlsplit(url).scheme.lower()
        kind = "http" if scheme == "https" else scheme
        source = self._by_kind.get(kind)
        if source is not None:
            return source
        if kind == "http":
            source = HttpSource(self.settings, budget=self.budget)
        elif kind == "file":
            source = FileSource(self.settings)
        elif kind == "s3":
            source = S3Source(self.settings, budget=self.budget)  # reads AWS config: may raise
        elif kind == "ais":
            source = AisSource(self.settings, budget=self.budget)
        elif kind == "hf":
            from shardfs.sources.hf import HfSource

            source = HfSource(self.settings, budget=self.budget)
        elif kind == "gs":
            from shardfs.sources.gs import GsSource

            source = GsSource(self.settings, budget=self.budget)
        else:
            named = f"scheme {scheme!r}" if scheme else "no scheme"
            raise SourceError(f"{url}: unsupported URL ({named}); supported: {SUPPORTED}")
        earlier = self._before.get(kind)
        if earlier is not None and hasattr(source, "take_over"):
            source.take_over(earlier)
        self._by_kind[kind] = source
        return source

    def _opened(self) -> list[Source]:
        return list(self._by_kind.values())

    def stats(self) -> SourceStats:
        """Counters of all sources, summed."""
        total = SourceStats()
        closed = list(self._closed.values())
        for s in [self._earlier] + [source.stats for source in self._opened() + closed]:
            for f in fields(SourceStats):
                if f.name not in ("by_status", "credential_providers"):
                    setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
            for status, count in s.by_status.items():
                total.by_status[status] = total.by_status.get(status, 0) + count
        total.credential_providers = {**self._earlier.credential_providers,
                                      **self.credential_providers()}
        return total

    def url_query_until(self) -> float | None:
        """When the signature in the URL query that http(s) requests carry expires (the
        query in effect now: a renewed one's), if the http source is open and says."""
        source = self._by_kind.get("http")
        return source.url_query_until() if isinstance(source, HttpSource) else None

    def credential_providers(self) -> dict[str, str]:
        """Which credential provider each opened source signs with (names, never secrets)."""
        out = {}
        for kind, source in self._by_kind.items():
            method = getattr(source, "credential_method", None)
            if method:
                out[kind] = method
        return out

    async def aclose(self) -> None:
        opened = self._by_kind
        self._by_kind = {}
        for kind, source in opened.items():
            self._closed[kind] = source
            await source.aclose()
