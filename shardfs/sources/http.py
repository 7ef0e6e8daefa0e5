"""Shards over HTTP(S): byte ranges on one keep-alive client, resumable, with retries."""

from __future__ import annotations

import email.utils
import functools
import logging
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing, suppress
from dataclasses import replace
from typing import Any, cast
from urllib.parse import urlsplit

import httpcore
import httpx
import trio
from cachetools import LRUCache

from shardfs import __version__
from shardfs.sources.base import (
    NotFound,
    RangeNotSupported,
    ShardChanged,
    ShardInfo,
    SourceError,
    SourceSettings,
    SourceStats,
    Unreachable,
    Written,
    check_span,
)
from shardfs.sources.budget import RequestBudget
from shardfs.sources.h1 import (
    SPLICED_BODIES,
    Answer,
    Http11Pool,
    NotForUs,
    RequestHead,
    proxy_in_environment,
)
from shardfs.util.fileio import pwrite_all
from shardfs.util.urls import earliest_signed_until, query_signed_until

GONE = frozenset({403, 404, 410})
RETRYABLE = frozenset({408, 429})  # plus every 5xx
THROTTLING = frozenset({429, 503})  # "slow down" (S3 SlowDown is a 503): cut the budget
Response = httpx.Response | Answer  # what a GET returns (Answer: h1.get's, see HttpSource._head)
URL_QUERY_ENV = "SHARDFS_URL_QUERY"
REFUSED = (401, 403)  # statuses after which a URL query file is read again
URLS_PARSED = 4096  # shard URLs kept parsed (HttpSource._parsed, HttpSource._head)
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)
_UNSATISFIED_RANGE = re.compile(r"bytes\s+\*/(\d+)\s*$", re.IGNORECASE)

log = logging.getLogger(__name__)

# httpcore reads a response body 64 KiB per receive (AsyncHTTP11Connection.READ_NUM_BYTES, a
# class constant with no option for it). A shard is megabytes, and every receive costs Python
# work in httpcore and h11: reading up to 1 MiB at a time takes 15-35 % less CPU per byte
# (docs/benchmarks-notes.md, "CPU per byte received over HTTP"). A receive returns what has arrived,
# so no read waits for the larger size.
HTTP_RECEIVE_BYTES = 1 << 20


def receive_in_larger_pieces() -> bool:
    """Raise httpcore's per-receive size (for the whole process); False where this httpcore
    has no such constant (then its own size stays, and tests/test_sources.py says so)."""
    conn = httpcore.AsyncHTTP11Connection
    if not isinstance(getattr(conn, "READ_NUM_BYTES", None), int):
        return False
    conn.READ_NUM_BYTES = max(conn.READ_NUM_BYTES, HTTP_RECEIVE_BYTES)
    return True


class _TransportMadeOnFirstUse(httpx.AsyncBaseTransport):
    """httpx's transport, made when httpx first sends a request. Making it makes an SSL
    context (~35 ms of CPU on 2 cores, ~70 ms under load), and a mount makes its source when
    its first read arrives, so that time was every reader's first wait; most mounts never
    send a request through httpx (sources/h1.py carries their GETs)."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._made: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._made is None:
            self._made = httpx.AsyncHTTPTransport(**self._options)
        return await self._made.handle_async_request(request)

    async def aclose(self) -> None:
        if self._made is not None:
            await self._made.aclose()


class _HideQueries(logging.Filter):
    """httpx logs every request's URL (at info level). Query strings can carry credentials
    (presigned file-store URLs the Hugging Face Hub redirects to, with their signatures), so
    the logged URL is cut at the `?`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, httpx.URL) and a.query for a in args):
            record.args = tuple(a.copy_with(query=b"") if isinstance(a, httpx.URL) else a
                                for a in args)
        return True


logging.getLogger("httpx").addFilter(_HideQueries())
# httpcore's debug trace prints response headers (a redirect's Location: a presigned URL).
logging.getLogger("httpcore").setLevel(logging.INFO)


class _Retry(Exception):
    """An attempt failed in a way that may go away: try again after a backoff."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class _RetryWarnings:
    """At most one retry warning per host per interval; the next one says how many were not
    shown. A server that is down for a minute gave dozens of identical lines per shard."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._hidden: dict[str, int] = {}

    def warn(self, url: str, message: str) -> None:
        host = urlsplit(url).netloc or url
        now = time.monotonic()
        last = self._last.get(host)
        if last is not None and now - last < self.interval:
            self._hidden[host] = self._hidden.get(host, 0) + 1
            return
        hidden = self._hidden.pop(host, 0)
        self._last[host] = now
        more = f" ({hidden} more retries on {host} not shown)" if hidden else ""
        log.warning("%s%s", message, more)


RETRY_WARNINGS = _RetryWarnings(interval=10.0)


@functools.cache
def _say_proxy_once() -> None:
    """Log, once per process, that GETs go through httpx because of a proxy (the stats count
    them: `httpx_requests`)."""
    log.info("a proxy is set in the environment (http_proxy, https_proxy or all_proxy): "
             "GETs go through it with httpx, at several times the CPU per GET of "
             "shardfs's own connections (docs/sources.md)")


class _Patience:
    """Backoff and deadline bookkeeping for one operation on one URL.

    The deadline counts time without progress on the URL, not per operation. `down` holds
    each URL whose operation ran out of deadline: (when that happened, when the URL last made
    progress). Every operation on such a URL that has made no progress since then gets a
    grace of one request timeout (enough to get past a dead pooled connection, or to find the
    server back) instead of a whole deadline of its own; the first progress clears the entry.
    Without this, the kernel's immediate retry of a failed page read made an EIO take two
    deadlines, or more when the retry joined a fetch started just before (issue #7)."""

    def __init__(self, url: str, settings: SourceSettings, stats: SourceStats,
                 down: dict[str, tuple[float, float]]) -> None:
        self._url = url
        self._settings = settings
        self._stats = stats
        self._down = down
        self._last_progress = trio.current_time()
        self._backoff = settings.backoff_initial

    def progress(self) -> None:
        self._last_progress = trio.current_time()
        self._backoff = self._settings.backoff_initial
        self._down.pop(self._url, None)

    async def wait(self, failure: _Retry) -> None:
        """Sleep before the next attempt, or raise Unreachable once the deadline has passed."""
        settings = self._settings
        now = trio.current_time()
        expires = self._last_progress + settings.deadline
        since = self._last_progress
        down = self._down.get(self._url)
        if down is not None:
            declared, since = down
            grace = min(settings.timeout, settings.deadline)
            expires = min(expires, max(declared, self._last_progress) + grace)
        remaining = expires - now
        if remaining <= 0:
            self._down.setdefault(self._url, (now, since))
            raise Unreachable(
                f"{self._url}: unreachable, no progress for {now - since:.1f} s "
                f"(deadline {settings.deadline:g} s); last error: {failure}"
            )
        # Full jitter (a uniform draw below the exponential cap): clients failing together,
        # e.g. many nodes throttled by one store, spread their retries instead of returning
        # in lockstep.
        delay = random.uniform(0, self._backoff)
        self._backoff = min(self._backoff * 2, settings.backoff_max)
        if failure.retry_after is not None:
            delay = max(delay, failure.retry_after)  # the server knows best, within the deadline
        self._stats.retries += 1
        RETRY_WARNINGS.warn(self._url, f"{self._url}: {failure}; retrying in "
                                       f"{min(delay, remaining):.2f} s")
        await trio.sleep(min(delay, remaining))


class HttpSource:
    """Shards served over http:// or https:// by a server that supports Range requests."""

    def __init__(self, settings: SourceSettings | None = None, *,
                 budget: RequestBudget | None = None) -> None:
        self.settings = settings or SourceSettings()
        self.stats = SourceStats()
        # Shared by all sources of a mount (Sources passes its own); one per source otherwise.
        self.budget = budget or RequestBudget(self.settings.request_rate,
                                              self.settings.request_burst)
        # URL -> (when it ran out of deadline, its last progress); see _Patience.
        self._down: dict[str, tuple[float, float]] = {}
        # Servers (scheme://host:port) that have answered at least once. A refused connection
        # or an unknown host on first contact is a wrong URL or a server that is not running:
        # it fails at once. Retries with backoff are for servers that answered before.
        self.answered: set[str] = set()
        receive_in_larger_pieces()
        s = self.settings
        limits = httpx.Limits(max_connections=s.max_connections,
                              max_keepalive_connections=s.max_connections)
        env_proxy = proxy_in_environment()
        self._client = httpx.AsyncClient(
            # No pool timeout: waiting for one of our own connections is not a server failure.
            timeout=httpx.Timeout(s.timeout, pool=None),
            # httpx reads proxies from the environment only when it makes its own transport.
            limits=limits, transport=None if env_proxy else _TransportMadeOnFirstUse(limits=limits),
            # Byte offsets refer to the stored bytes, so no transparent compression.
            headers={"Accept-Encoding": "identity", "User-Agent": f"shardfs/{__version__}"},
            follow_redirects=True,
        )
        # GETs go over connections of our own (sources/h1.py: a fifth of httpx's CPU per
        # GET); proxies and unusual answers stay with httpx.
        proxied = s.http_client != "httpx" and env_proxy
        if proxied:
            _say_proxy_once()
        self._h1 = None if s.http_client == "httpx" or proxied \
            else Http11Pool(s.max_connections, s.timeout, stats=self.stats)
        self._urls: LRUCache[str, httpx.URL] = LRUCache(maxsize=URLS_PARSED)
        # A GET goes out as bytes made once per URL (h1.RequestHead) plus its own headers,
        # and comes back as an h1.Answer: no httpx objects per GET (see _head).
        self._lean = self._h1 is not None and self._lean_requests()
        self._heads: LRUCache[str, RequestHead | None] = LRUCache(maxsize=URLS_PARSED)
        self._url_query = url_query_of(s)

    def take_over(self, earlier: HttpSource) -> None:
        """Continue where `earlier` (closed, of an earlier event loop) stopped: servers that
        answered it are not first contacts here, a URL query it renewed from its file
        is the one in effect, and the round trips its connections measured size the small
        windows of the cold start's downloads (sources/window.py) before any connection of
        this loop is made."""
        self.answered |= earlier.answered
        self._url_query = earlier._url_query
        if self._h1 is not None and earlier._h1 is not None:
            for origin, rtt in earlier._h1.rtt.items():
                self._h1.rtt[origin] = min(rtt, self._h1.rtt.get(origin, rtt))

    async def aclose(self) -> None:
        if self._h1 is not None:
            await self._h1.aclose()
        await self._client.aclose()

    # -- stat ---------------------------------------------------------------------------------

    async def stat(self, url: str) -> ShardInfo:
        patience = _Patience(url, self.settings, self.stats, self._down)
        while True:
            try:
                info = await self._stat_once(url)
            except _Retry as failure:
                await patience.wait(failure)
            else:
                patience.progress()
                return info

    async def _stat_once(self, url: str) -> ShardInfo:
        # GET of one byte rather than HEAD: it proves the server honours Range.
        async with self._request(url, {"Range": "bytes=0-0"}) as resp:
            status = resp.status_code
            whole_only = False
            if status == 206:
                size = _parse_content_range(resp, url)[2]
            elif status == 416:
                size = _unsatisfied_total(resp, url)
            elif status == 200 and resp.headers.get("content-length") == "0":
                size = 0  # an empty object: nothing to range over
            elif status == 200:
                # No Range support (python -m http.server, some CDNs and proxies): the shard
                # can still be read whole. Its size must be known; the body is not read
                # (closing the response drops the connection).
                size = _content_length(resp, url)
                whole_only = True
            else:
                raise self._status_error(resp, url)
            if not whole_only:
                await self._read_small(resp, url)  # let the connection be reused
            return ShardInfo(
                url=url,
                size=size,
                etag=resp.headers.get("etag"),
                last_modified=resp.headers.get("last-modified"),
                whole_only=whole_only,
            )

    # -- stream -------------------------------------------------------------------------------

    def stream(self, shard: ShardInfo, start: int, end: int) -> AsyncIterator[bytes]:
        # Without `into` the pieces are all bytes; the generator itself is returned (a GET
        # per member through Lookahead: no layer more per piece).
        return cast("AsyncIterator[bytes]", self._stream(shard, start, end, None))

    def stream_into(self, shard: ShardInfo, start: int, end: int,
                    into: int) -> AsyncIterator[bytes | Written]:
        """As `stream`, each piece also written at its offset in the shard into the file
        `into` (the reader's cache file) before it is yielded. Over a plain TCP connection of
        our own (h1) the body goes from the socket into the file without passing through
        Python (splice(2)), and the pieces are `Written` (the caller reads back what it
        checks); otherwise they are the bytes, written by this loop. An OSError of the
        write (a full disk) is raised as the caller's own would be."""
        return self._stream(shard, start, end, into)

    async def _stream(self, shard: ShardInfo, start: int, end: int,
                      into: int | None) -> AsyncIterator[bytes | Written]:
        check_span(shard, start, end)
        pos = start
        # Only bytes count as progress here: a server that answers and then drops every
        # connection before sending anything must still run into the deadline.
        patience = _Patience(shard.url, self.settings, self.stats, self._down)
        chunk = self.settings.chunk_size
        # The body goes into `into` by splice where the answer allows (below); its head is
        # then read alone (h1.py).
        splice = into is not None and not shard.whole_only
        while pos < end:
            try:
                headers = _whole_headers(shard) if shard.whole_only \
                    else _range_headers(shard, pos, end)
                async with self._request(shard.url, headers, splice) as resp:
                    stop = await self._check_partial(resp, shard, pos, end)
                    # A body that ends at `stop` is read to its end, so that its connection
                    # is reused (leaving it early closes the connection); a longer one (a whole
                    # shard, a range past `end`) is cut off there.
                    cut = resp.status_code != 206 or \
                        _parse_content_range(resp, shard.url)[1] + 1 > stop
                    spliced = None
                    if splice and isinstance(resp, Answer):
                        assert into is not None
                        spliced = resp.splice_into(into, pos, stop - pos)
                    if spliced is not None:
                        async with aclosing(spliced) as written:
                            async for n, spliced_n in written:
                                self.stats.bytes_received += n
                                self.stats.spliced_bytes += spliced_n
                                pos += n
                                yield Written(pos - n, n)
                                patience.progress()
                        if pos < stop:
                            raise self._retry(f"response ended at byte {pos}, expected {stop}")
                        continue
                    # A whole-only shard is always sent from byte 0: skip what we already
                    # yielded (a resumed transfer) or what the caller did not ask for.
                    at = 0 if shard.whole_only else pos
                    async for data in resp.aiter_raw():
                        self.stats.bytes_received += len(data)
                        if at < pos:
                            skip = min(len(data), pos - at)
                            at += skip
                            data = data[skip:]
                        data = data[: stop - pos]
                        at += len(data)
                        for i in range(0, len(data), chunk):
                            piece = data[i : i + chunk]
                            if into is not None:
                                pwrite_all(into, piece, pos)
                            pos += len(piece)
                            yield piece
                            # After the yield: time the consumer spends is not our stall.
                            patience.progress()
                        if pos >= stop and cut:
                            break
                    if pos < stop:
                        raise self._retry(f"response ended at byte {pos}, expected {stop}")
            except _Retry as failure:
                await patience.wait(failure)

    async def _check_partial(
        self, resp: Response, shard: ShardInfo, pos: int, end: int
    ) -> int:
        """Validate a response to a ranged GET; return where its body ends in the shard."""
        url, status = shard.url, resp.status_code
        if status == 206:
            first, last, total = _parse_content_range(resp, url)
            if total != shard.size:
                raise ShardChanged(f"{url}: size is now {total}, was {shard.size} at mount time")
            self._check_validators(resp, shard)
            if first != pos or last < first:
                raise SourceError(f"{url}: asked for bytes from {pos}, server sent {first}-{last}")
            return min(last + 1, end)
        if status == 412:
            raise ShardChanged(f"{url}: changed since mount time (HTTP 412, validator mismatch)")
        if status == 416:
            raise ShardChanged(f"{url}: bytes {pos}-{end - 1} no longer exist (HTTP 416)")
        if status == 200 and shard.whole_only:
            total = _content_length(resp, url)
            if total != shard.size:
                raise ShardChanged(f"{url}: size is now {total}, was {shard.size} at mount time")
            self._check_validators(resp, shard)
            return end
        if status == 200:
            self._check_validators(resp, shard)
            raise RangeNotSupported(
                f"{url}: the server stopped honouring Range requests (HTTP 200 instead of 206)"
            )
        if status in GONE:
            raise NotFound(f"{url}: no longer available (HTTP {status})"
                           f"{self._refusal_hint(status, url)}")
        raise self._status_error(resp, url)

    @staticmethod
    def _check_validators(resp: Response, shard: ShardInfo) -> None:
        etag = resp.headers.get("etag")
        if shard.etag and etag and _strip_weak(etag) != _strip_weak(shard.etag):
            raise ShardChanged(f"{shard.url}: ETag is now {etag}, was {shard.etag} at mount time")
        modified = resp.headers.get("last-modified")
        if not shard.etag and shard.last_modified and modified and modified != shard.last_modified:
            raise ShardChanged(f"{shard.url}: modified at {modified}, after mount time")

    # -- fetch_optional -----------------------------------------------------------------------

    async def fetch_optional(self, url: str) -> bytes | None:
        patience = _Patience(url, self.settings, self.stats, self._down)
        while True:
            try:
                data = await self._fetch_once(url)
            except _Retry as failure:
                await patience.wait(failure)
            else:
                patience.progress()
                return data

    async def _fetch_once(self, url: str) -> bytes | None:
        async with self._request(url, {}) as resp:
            if resp.status_code in GONE:
                return None
            if resp.status_code != 200:
                raise self._status_error(resp, url)
            return await self._read_small(resp, url)

    # -- plumbing -----------------------------------------------------------------------------

    async def _before_attempt(self) -> None:
        """Await what a request needs before it is built: a token from the request budget
        (and, in subclasses, fresh credentials)."""
        waited = await self.budget.acquire()
        if waited:
            self.stats.budget_waits += 1
            self.stats.budget_wait_s += waited

    def _request(self, url: str, headers: dict[str, str], spliced: bool = False) -> _Attempt:
        """`spliced`: the answer's body will go into a file by `splice_into` (h1.py reads
        its head alone then, SPLICED_BODIES)."""
        return _Attempt(self, url, lambda: self._build_request(url, headers), headers, spliced)

    def _lean_requests(self) -> bool:
        """Whether GETs may go as h1.RequestHead bytes: where no subclass builds them its own
        way (a subclass that does says so itself: S3Source)."""
        return type(self)._build_request is HttpSource._build_request

    def _head(self, url: str) -> RequestHead | None:
        """The URL's request head for `Http11Pool.get`, or None where the GET goes through
        httpx.Request (a subclass builds it, proxies, a scheme h1 does not carry)."""
        if not self._lean:
            return None
        try:
            return self._heads[url]
        except KeyError:
            pass
        assert self._h1 is not None
        request = self._unsigned_request(url)
        head = self._heads[url] = RequestHead(request) if self._h1.takes(request) else None
        return head

    def _unsigned_request(self, url: str) -> httpx.Request:
        """The GET for `url` without headers of its own: what its RequestHead is made of."""
        return self._build_request(url, {})

    def _lean_headers(self, head: RequestHead, headers: dict[str, str]) -> dict[str, str]:
        """The headers one GET adds to its URL's RequestHead (a subclass adds a signature)."""
        return headers

    async def _send_lean(self, url: str, head: RequestHead,
                         headers: dict[str, str]) -> Response:
        """A GET as `_send` sends it, from the URL's request head."""
        assert self._h1 is not None
        if self._h1.takes_origin(head.origin):
            sent = self._lean_headers(head, headers)
            try:
                answer = await self._h1.get(head.origin, head.with_headers(sent))
            except NotForUs:
                pass
            else:
                answer.sent = {name.lower(): value for name, value in sent.items()}
                return answer
        self.stats.httpx_requests += 1
        return await self._client.send(self._build_request(url, headers), stream=True)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send a built request: over our own HTTP/1.1 connections where they take it,
        through httpx otherwise (and for an answer they leave to httpx: sent again)."""
        h1 = self._h1
        if h1 is not None and h1.takes(request):
            try:
                return await h1.send(request)
            except NotForUs:
                pass
        self.stats.httpx_requests += 1
        return await self._client.send(request, stream=True)

    def _renewed_query(self, used: str) -> bool:
        """After a refusal (401/403) of a request made with the URL query `used`: whether
        it should be sent again with another one, because the query file (the config's
        `credentials: {url_query: {file: ...}}`) now holds a new token, or another request
        took it up meanwhile."""
        path = self.settings.url_query_file
        if path is None or not self._carries_query():
            return False
        try:  # the file, as at mount time (url_query_of reads it when no value is given)
            query = url_query_of(replace(self.settings, url_query=None))
        except SourceError as exc:
            log.warning("%s", exc)
            return used != self._url_query
        if query != self._url_query:
            self._url_query = query
            self._urls.clear()  # parsed and request heads carry the old one
            self._heads.clear()
            log.info("a request was refused: the URL query was read again from %s (a new "
                     "token)", path)
        return used != self._url_query

    def _build_request(self, url: str, headers: dict[str, str]) -> httpx.Request:
        """The GET for `url`; built anew for every attempt. Subclasses map URLs to requests
        and sign them here (S3), so a retry carries a fresh signature."""
        return self._client.build_request("GET", self._parsed(url, self._url_query),
                                          headers=headers)

    def _parsed(self, url: str, query: str = "") -> httpx.URL:
        """`url` (with `query` added to its own) parsed once: a GET built from a string parses
        it again (~60 of its ~65 µs on 2 cores), and `Lookahead` makes a GET per file of the
        same few shard URLs."""
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = httpx.URL(with_query(url, query))
        return parsed

    async def _read_small(self, resp: Response, url: str) -> bytes:
        limit = self.settings.max_fetch_bytes
        parts: list[bytes] = []
        size = 0
        async for data in resp.aiter_raw():
            self.stats.bytes_received += len(data)
            size += len(data)
            if size > limit:
                raise SourceError(f"{url}: larger than {limit} bytes, refusing to load it whole")
            parts.append(data)
        return b"".join(parts)

    def _retry(self, reason: str, retry_after: float | None = None) -> _Retry:
        self.stats.errors += 1
        return _Retry(reason, retry_after)

    def _status_error(self, resp: Response, url: str) -> Exception:
        status = resp.status_code
        if status >= 500 or status in RETRYABLE:
            retry_after = _retry_after(resp.headers.get("retry-after"))
            return self._retry(f"HTTP {status} {resp.reason_phrase}", retry_after)
        self.stats.errors += 1
        if status in GONE:
            return NotFound(f"{url}: not found (HTTP {status}){_directory_hint(url)}"
                            f"{self._refusal_hint(status, url)}")
        return SourceError(f"{url}: unexpected HTTP {status} {resp.reason_phrase}"
                           f"{self._refusal_hint(status, url)}")

    def url_query_until(self) -> float | None:
        """When the signature in the query these requests carry expires (None: none says)."""
        return query_signed_until(self._url_query) if self._carries_query() else None

    def _carries_query(self) -> bool:
        """Whether requests carry the URL query: plain http(s) ones, not those a subclass
        builds (S3, GCS, HF sign their own)."""
        return type(self)._build_request is HttpSource._build_request

    def _refusal_hint(self, status: int, url: str) -> str:
        if status not in REFUSED or not self._carries_query() or \
                not (self._url_query or "?" in url):
            return ""
        return f" (an expired or wrong signed-URL token? {renewal_advice(self.settings)})"


class _Attempt:
    """One streamed request: counts it, turns transport failures into _Retry, always closes.

    (httpx's own stream context manager, plus the bookkeeping every call site needs.)
    `url` names the object in messages; `build` makes the request (called once per attempt).
    A plain GET (`headers` given, see HttpSource._head) goes as bytes over h1 instead."""

    def __init__(self, source: HttpSource, url: str, build: Callable[[], httpx.Request],
                 headers: dict[str, str] | None = None, spliced: bool = False) -> None:
        self._source = source
        self._url = url
        self._build = build
        self._headers = headers  # a plain GET's own (HttpSource._request): it may go lean
        self._spliced = spliced  # its body will be spliced: h1 reads the head alone
        self._resp: Response | None = None

    async def __aenter__(self) -> Response:
        src = self._source
        await src._before_attempt()
        src.stats.requests += 1
        origin = None
        query = src._url_query  # what this request carries (see _renewed_query)
        spliced = SPLICED_BODIES.set(self._spliced)
        try:
            head = None if self._headers is None else src._head(self._url)
            if head is not None:
                assert self._headers is not None
                origin = _origin(head.url)
                self._resp = await src._send_lean(self._url, head, self._headers)
            else:
                request = self._build()
                origin = _origin(request.url)
                self._resp = await src._send(request)
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
            src.stats.errors += 1
            raise SourceError(f"{self._url}: {e}") from e
        except httpx.ConnectError as e:
            if origin is not None and origin not in src.answered:
                src.stats.errors += 1
                raise Unreachable(f"{self._url}: cannot connect to {origin} ({_describe(e)}); "
                                  "check the URL and that the server is running") from None
            raise src._retry(_describe(e)) from e
        except httpx.TransportError as e:
            raise src._retry(_describe(e)) from e
        finally:
            SPLICED_BODIES.reset(spliced)
        src.answered.add(origin)
        status = self._resp.status_code
        src.stats.by_status[status] = src.stats.by_status.get(status, 0) + 1
        if status in THROTTLING:
            src.stats.throttled += 1
            src.budget.throttled()
        elif status < 400:
            src.budget.succeeded()
        elif status in REFUSED and src._renewed_query(query):
            # __aexit__ does not run when __aenter__ raises: close the answer here.
            resp, self._resp = self._resp, None
            await resp.aclose()
            raise src._retry(f"HTTP {status}: sent again with the renewed URL query")
        return self._resp

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._resp is not None:
            # Closing an unfinished response drops its connection instead of reusing it.
            await self._resp.aclose()
        if isinstance(exc, httpx.TransportError):
            raise self._source._retry(_describe(exc)) from exc


def url_query_of(settings: SourceSettings) -> str:
    """The query every plain http(s) request of a mount carries besides its URL's own: the
    settings' (the config's `credentials: {url_query: ...}`), else what their
    `url_query_file` holds (`doctor MOUNTPOINT`: the mount's stats name the file), else
    $SHARDFS_URL_QUERY; "" for none. A leading `?` is dropped. SourceError (never showing the
    value) if it cannot be read or be part of a URL."""
    query = settings.url_query
    if query is None and settings.url_query_file is not None:
        try:
            with open(settings.url_query_file) as f:
                query = f.read()
        except OSError as exc:
            raise SourceError(f"cannot read the URL query from {settings.url_query_file}: "
                              f"{exc.strerror}") from None
    if query is None:
        query = os.environ.get(URL_QUERY_ENV, "")
    query = query.strip().removeprefix("?")
    if any(c.isspace() or c == "#" for c in query):
        raise SourceError(f"the URL query ({URL_QUERY_ENV} or credentials.url_query) contains "
                          "a blank or a '#': expected the text after '?' in a signed URL, "
                          "e.g. sv=...&sig=...")
    return query


def signatures_expire(urls: list[str], settings: SourceSettings) -> float | None:
    """The earliest time (Unix) at which a signature in the shards' URLs, or in the URL query
    added to their http(s) requests, expires; None when none says."""
    times = [earliest_signed_until(urls)]
    if any(url.startswith(("http:", "https:")) for url in urls):
        with suppress(SourceError):  # a query that cannot be read says nothing here
            times.append(query_signed_until(url_query_of(settings)))
    return min((t for t in times if t is not None), default=None)


def renewal_advice(settings: SourceSettings) -> str:
    """What to do about an expired or refused signed-URL token."""
    path = settings.url_query_file
    return (f"write a new token to {path} (read again at the next refusal)" if path
            else "mount again with a new token")


def with_query(url: str, query: str) -> str:
    """`url` with `query` added after its own query (if any); `url` itself for no query."""
    if not query:
        return url
    base, hash_, fragment = url.partition("#")
    return f"{base}{'&' if '?' in base else '?'}{query}{hash_}{fragment}"


def _directory_hint(url: str) -> str:
    """A URL that names a directory gets 403/404 from most servers: say what to give instead."""
    path = urlsplit(url).path
    if path.endswith("/") or "." not in path.rsplit("/", 1)[-1]:
        return ("; if this is a directory: HTTP directory listings are not a source, name the "
                "shards with a brace pattern (.../train-{000000..000099}.tar) or a manifest "
                "(.txt, one URL per line)")
    return ""


def sent_headers(resp: Response) -> Mapping[str, str]:
    """The headers a GET was sent with, by lower-case name (S3 and GCS read their signature
    or token from them to know which credentials a refusal was for)."""
    return resp.sent if isinstance(resp, Answer) else resp.request.headers


def _origin(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}"


def _whole_headers(shard: ShardInfo) -> dict[str, str]:
    """A plain GET of the whole shard, conditional on the version seen at mount time."""
    if shard.etag and not shard.etag.startswith("W/"):
        return {"If-Match": shard.etag}
    if shard.last_modified:
        return {"If-Unmodified-Since": shard.last_modified}
    return {}


def _content_length(resp: Response, url: str) -> int:
    value = resp.headers.get("content-length", "")
    if not value.isdigit():
        raise SourceError(f"{url}: the server ignores Range requests and sends no "
                          "Content-Length, so the shard's size cannot be known; serve it "
                          "from a server that supports Range requests")
    return int(value)


def _range_headers(shard: ShardInfo, start: int, end: int) -> dict[str, str]:
    headers = {"Range": f"bytes={start}-{end - 1}"}
    # If-Match needs a strong ETag; a weak one would always fail with 412.
    if shard.etag and not shard.etag.startswith("W/"):
        headers["If-Match"] = shard.etag
    elif shard.last_modified:
        headers["If-Unmodified-Since"] = shard.last_modified
    return headers


def _parse_content_range(resp: Response, url: str) -> tuple[int, int, int]:
    value = resp.headers.get("content-range", "")
    m = _CONTENT_RANGE.match(value.strip())
    if m is None or m.group(3) == "*":
        raise SourceError(f"{url}: unusable Content-Range {value!r} in a 206 response")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _unsatisfied_total(resp: Response, url: str) -> int:
    """Size from a 416 answer to `bytes=0-0`: only an empty object can refuse that range."""
    value = resp.headers.get("content-range", "")
    m = _UNSATISFIED_RANGE.match(value.strip())
    if m is None or int(m.group(1)) != 0:
        raise SourceError(
            f"{url}: the server refused bytes=0-0 (HTTP 416, Content-Range {value!r}); "
            "cannot tell the object's size"
        )
    return 0


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _strip_weak(etag: str) -> str:
    return etag.removeprefix("W/")


def _describe(e: Exception) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
