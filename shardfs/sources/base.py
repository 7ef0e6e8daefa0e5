"""The small async interface every shard backend implements (HTTP, file, later S3/AIStore)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from shardfs.util.urls import unsigned


class SourceError(Exception):
    """A problem with a shard source, phrased for the user (the message names the URL)."""


class NotFound(SourceError):
    """The shard (or index file) does not exist at the source."""


class RangeNotSupported(SourceError):
    """The server stopped honouring Range requests it honoured at mount time."""


class ShardChanged(SourceError):
    """The shard's size/ETag/Last-Modified differ from the identity recorded at mount time."""


class Unreachable(SourceError):
    """No progress for longer than the deadline (network down, server stalled or failing)."""


class Written:
    """Bytes a source wrote straight into the caller's file (`stream_into`), at `offset`,
    without bringing them into Python: the caller reads them back where it needs them (its
    checks). len() is their count, as of a piece of bytes."""

    __slots__ = ("offset", "size")

    def __init__(self, offset: int, size: int) -> None:
        self.offset = offset
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"Written({self.offset}, {self.size})"


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """What a source says about one shard: enough to key caches and detect changes."""

    url: str
    size: int
    etag: str | None = None
    last_modified: str | None = None
    # The server ignores Range requests: the shard can only be read whole, from its start
    # (no member reads; the reader waits for its whole-shard fetch, as for compressed shards).
    whole_only: bool = False

    @property
    def identity(self) -> str:
        """Stable text naming this exact version of the shard (URL + size + validators). The
        URL without a signature in its query (util/urls.py, `unsigned`): a new token names the
        same bytes, so its cache entries and index stay."""
        return "\0".join((unsigned(self.url), str(self.size), self.etag or "",
                          self.last_modified or ""))


@dataclass(slots=True)
class SourceSettings:
    """Network behaviour shared by all sources."""

    timeout: float = 10.0  # seconds: connect / read-stall limit of one request
    deadline: float = 60.0  # seconds without progress before a read fails with Unreachable
    max_connections: int = 32
    # "auto": GETs over our own HTTP/1.1 connections (sources/h1.py), proxies and unusual
    # answers through httpx; "httpx": everything through httpx.
    http_client: str = "auto"
    backoff_initial: float = 0.1  # seconds; doubles per retry up to backoff_max
    backoff_max: float = 5.0
    chunk_size: int = 1 << 20  # preferred size of yielded chunks (HTTP may yield smaller)
    max_fetch_bytes: int = 256 << 20  # fetch_optional refuses bigger objects (indexes are small)
    # Request budget per mount (sources/budget.py): requests per second; None: unlimited
    # until the store throttles (then adaptive). `request_burst` requests may go at once.
    request_rate: float | None = None
    request_burst: int = 64
    # s3:// (None: from the environment / AWS config files; see shardfs/sources/s3.py)
    s3_endpoint: str | None = None  # S3-compatible store, e.g. http://minio:9000
    s3_region: str | None = None
    s3_profile: str | None = None  # profile in ~/.aws/credentials and ~/.aws/config
    s3_addressing: str = "auto"  # auto | path | virtual (auto: path-style on custom endpoints)
    # ais:// (None: $AIS_ENDPOINT, else http://localhost:8080)
    ais_endpoint: str | None = None
    # hf:// (None: $HF_ENDPOINT, else https://huggingface.co)
    hf_endpoint: str | None = None
    # gs:// (None: $STORAGE_EMULATOR_HOST, else https://storage.googleapis.com)
    gs_endpoint: str | None = None
    # Keys from the mount's config file (`credentials:`, given by reference there); they win
    # over the environment and the AWS files. Never logged.
    s3_credentials: dict[str, str] | None = field(default=None, repr=False)
    # A query added to every http(s) request (a signed URL's token kept out of the source
    # URLs: an Azure SAS); None: $SHARDFS_URL_QUERY, if set. Never logged (sources/http.py).
    url_query: str | None = field(default=None, repr=False)
    # The file url_query was read from (the config's `{file: PATH}`): read again when a
    # request is refused (401/403), so that a new token written there is taken up.
    url_query_file: str | None = None


@dataclass(slots=True)
class SourceStats:
    """Counters a source keeps; read by `shardfs stats` and the tests."""

    requests: int = 0
    # Of them, sent through httpx's client rather than shardfs's own connections (sources/h1.py):
    # proxies in the environment, --http-client httpx, answers h1 leaves to httpx (redirects,
    # chunked bodies). Each costs several times the CPU (docs/sources.md).
    httpx_requests: int = 0
    bytes_received: int = 0
    # Of them, written from the socket into the cache file without passing through Python
    # (splice(2): whole-shard downloads over plain http://; sources/h1.py)
    spliced_bytes: int = 0
    # Connections opened with a small receive window for downloads in a cold start
    # (sources/window.py)
    small_window_connections: int = 0
    retries: int = 0
    errors: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    throttled: int = 0  # answers asking us to slow down: 429, 503, S3 SlowDown
    budget_waits: int = 0  # requests that waited for the request budget (sources/budget.py)
    budget_wait_s: float = 0.0  # total seconds spent waiting for it
    credential_refreshes: int = 0  # temporary credentials obtained again (expiry, rotation)
    # Which credential provider each signing source uses (botocore's `method`, e.g.
    # {"s3": "iam-role"}): names only, never a secret. Filled in by Sources.stats().
    credential_providers: dict[str, str] = field(default_factory=dict)


def check_span(shard: ShardInfo, start: int, end: int) -> None:
    """Reject a byte span outside the shard: that is a caller bug, not a source problem."""
    if not 0 <= start <= end <= shard.size:
        raise ValueError(f"byte span [{start}, {end}) is outside {shard.url} (size {shard.size})")


class Source(Protocol):
    """One backend. All methods run on the trio event loop and must not block it.

    A source may also have `stream_into(shard, start, end, into)`: as `stream`, each piece
    written into the file `into` (the reader's part file) at its offset in the shard before
    it is yielded, as the bytes or, where Python never held them, as `Written` (FileSource:
    by the thread that read them; HttpSource: spliced from the socket over plain http)."""

    stats: SourceStats

    async def stat(self, url: str) -> ShardInfo:
        """Size and validators of a shard, and whether it can be read by byte ranges
        (`whole_only` when not).

        Raises NotFound, Unreachable, SourceError."""
        ...

    def stream(self, shard: ShardInfo, start: int, end: int) -> AsyncIterator[bytes]:
        """Yield the bytes [start, end) of `shard`, in order, in chunks.

        Resumes from the last byte yielded after a dropped connection, retries with backoff
        on 5xx and network errors, raises Unreachable after `deadline` seconds without
        progress, and ShardChanged if the source now serves a different version."""
        ...

    async def fetch_optional(self, url: str) -> bytes | None:
        """A small whole object (e.g. an index file next to a shard); None if it does not exist."""
        ...

    async def aclose(self) -> None: ...
