"""Plain http:// GETs over shardfs's own HTTP/1.1 connections (shardfs/sources/h1.py), against
real servers: nginx, a fault proxy in front of it, and small servers of ours that answer the
way h1 leaves to httpx (a redirect, a chunked body) or close a kept-alive connection."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import http.server
import os
import shutil
import socket
import ssl
import subprocess
import termios
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from bench.server import PortCap
from shardfs.devtools.datagen import make_imagefolder
from shardfs.devtools.nginx import Nginx, self_signed_certificate
from shardfs.pack import pack
from shardfs.sources import HttpSource, SourceSettings, Unreachable
from shardfs.sources.h1 import SPLICED_HEAD_RECEIVE, Http11Pool
from tests.conftest import SHARDFS, Dataset, Mounter, brace
from tests.faultproxy import FaultProxy
from tests.test_mount import publish
from tests.test_sources import (
    FAST,
    SIZE,
    http_server,
    put,
    read,
    read_into,
    with_http,
    zeroed_part,
)


def pool(source: HttpSource) -> Http11Pool:
    assert source._h1 is not None, "plain http:// GETs should go over h1's connections"
    return source._h1


def test_ranged_gets_share_kept_alive_connections(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    spans = [(i * 7919 % 900_000, i * 7919 % 900_000 + 1000 + i * 37) for i in range(120)]
    with FaultProxy(nginx.port) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"http://127.0.0.1:{proxy.port}/a.tar")
            got: dict[int, bytes] = {}

            async def reader(first: int) -> None:
                for i in range(first, len(spans), 8):
                    got[i] = await read(source, shard, *spans[i])

            async with trio.open_nursery() as nursery:
                for first in range(8):
                    nursery.start_soon(reader, first)
            assert all(got[i] == data[s:e] for i, (s, e) in enumerate(spans))
            h1 = pool(source)
            assert h1.sent == len(spans) + 1  # and the stat's GET
            assert h1.opened <= 8  # the 121 GETs went over at most 8 connections
            assert source.stats.retries == 0

        with_http(check)
        assert proxy.connections_accepted <= 8


def test_httpx_alone_when_asked_or_behind_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    async def make(settings: SourceSettings) -> Http11Pool | None:
        source = HttpSource(settings)
        await source.aclose()
        return source._h1

    assert trio.run(make, dataclasses.replace(FAST, http_client="httpx")) is None
    assert trio.run(make, FAST) is not None
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # httpx would use it; h1 cannot
    assert trio.run(make, FAST) is None


@contextlib.contextmanager
def odd_server(nginx: Nginx) -> Iterator[str]:
    """/moved.tar redirects to nginx's /a.tar; /chunked.idx answers 200 with a chunked body."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/moved.tar":
                self.send_response(302)
                self.send_header("Location", f"{nginx.url}/a.tar")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b"chunked ", b"index"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")

    with http_server(Handler) as url:  # h1 closes a connection after an answer it leaves
        yield url


def test_answers_h1_does_not_read_go_to_httpx(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    with odd_server(nginx) as url:

        async def check(source: HttpSource) -> None:
            assert await source.fetch_optional(f"{url}/chunked.idx") == b"chunked index"
            shard = await source.stat(f"{url}/moved.tar")  # followed by httpx
            assert await read(source, shard, 100, 5000) == data[100:5000]
            h1 = pool(source)
            assert ("http", "127.0.0.1", int(url.rsplit(":", 1)[1])) in h1.not_ours
            assert h1.sent == 1  # the first GET; the origin's others went to httpx directly
            # and the stats say so: the chunked answer sent again, the stat, the read
            assert source.stats.httpx_requests == source.stats.requests == 3

        with_http(check)


def test_no_ssl_context_is_made_until_httpx_sends(nginx: Nginx,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx's transport makes an SSL context (~35 ms of CPU here), and a mount makes its
    source when its first read arrives: plain http:// GETs over h1 make none, the first
    answer left to httpx makes httpx's transport and its context."""
    made: list[ssl.SSLContext] = []
    make = ssl.create_default_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    data = put(nginx.root, "a.tar")
    with odd_server(nginx) as odd:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{nginx.url}/a.tar")
            assert await read(source, shard, 100, 5000) == data[100:5000]
            assert pool(source).sent == 2 and made == [], made
            assert await source.fetch_optional(f"{odd}/chunked.idx") == b"chunked index"
            assert len(made) == 1 and source.stats.httpx_requests == 1

        with_http(check)


@contextlib.contextmanager
def serving(serve: Callable[[socket.socket], None]) -> Iterator[tuple[str, list[int]]]:
    """A server on 127.0.0.1 that runs `serve` on each accepted connection in a thread of its
    own. Yields the URL of /a.tar there and the count of connections accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = [0]

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted[0] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/a.tar", accepted
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)


@contextlib.contextmanager
def closes_on_second_request(body: bytes) -> Iterator[tuple[str, list[int]]]:
    """Answers the first GET of each connection (keep-alive, a Range of `body`), then closes
    the connection when the next request comes on it: a server dropping an idle connection
    just as the client reuses it. Yields the URL and the count of connections accepted."""

    def serve(conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(65536)
                if not data:
                    return
                request += data
            head = request.split(b"\r\n\r\n")[0].decode("latin-1")
            span = next(line for line in head.split("\r\n") if line.lower().startswith("range"))
            start, end = (int(x) for x in span.split("=")[1].split("-"))
            piece = body[start : end + 1]
            conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n"
                         b"Content-Range: bytes %d-%d/%d\r\n\r\n%s"
                         % (len(piece), start, end, len(body), piece))
            conn.recv(65536)  # the next request on this connection: not answered

    with serving(serve) as served:
        yield served


def test_a_connection_closed_as_it_is_reused_is_replaced_without_a_retry() -> None:
    body = bytes(range(256)) * 100
    with closes_on_second_request(body) as (url, accepted):

        async def check(source: HttpSource) -> None:
            shard = await source.stat(url)
            for start in (0, 5000, 20000):
                assert await read(source, shard, start, start + 3000) == body[start:start + 3000]
            assert source.stats.retries == 0 and source.stats.errors == 0
            assert pool(source).sent == 7  # 4 answered, 3 sent again on a fresh connection

        with_http(check)
        assert accepted[0] == 4


@pytest.fixture
def https_nginx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Nginx]:
    """nginx serving https with a self-signed certificate that the process trusts the way
    httpx does (SSL_CERT_FILE)."""
    cert, key = self_signed_certificate(tmp_path / "tls")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    (tmp_path / "www").mkdir()
    with Nginx(tmp_path / "www", tmp_path / "nginx", tls=(cert, key)) as server:
        yield server


def test_https_gets_go_over_h1_with_httpxs_trust(https_nginx: Nginx) -> None:
    data = put(https_nginx.root, "a.tar")
    assert https_nginx.url.startswith("https://")

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{https_nginx.url}/a.tar")
        for start in range(0, 900_000, 150_000):
            assert await read(source, shard, start, start + 70_000) == data[start:start + 70_000]
        h1 = pool(source)
        assert (h1.sent, h1.opened) == (7, 1)  # one TLS connection carried every GET

    with_http(check)


def test_https_stream_into_writes_the_decrypted_bytes(https_nginx: Nginx,
                                                      tmp_path: Path) -> None:
    """TLS bytes cannot be spliced: over https stream_into yields the bytes, each written
    into the file at its offset first, the connection kept for the next GET."""
    data = put(https_nginx.root, "a.tar")
    target = zeroed_part(tmp_path)

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{https_nginx.url}/a.tar")
        fd = os.open(target, os.O_RDWR)
        try:
            pieces = await read_into(source, shard, fd, 5, SIZE, data)
        finally:
            os.close(fd)
        assert all(isinstance(p, bytes) for p in pieces)
        assert source.stats.spliced_bytes == 0
        assert await read(source, shard, 7, 99) == data[7:99]
        assert pool(source).opened == 1

    with_http(check)
    assert target.read_bytes() == bytes(5) + data[5:]


def test_an_untrusted_certificate_fails_as_through_httpx(https_nginx: Nginx,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    put(https_nginx.root, "a.tar")
    monkeypatch.delenv("SSL_CERT_FILE")

    async def fails(client: str) -> str:
        source = HttpSource(dataclasses.replace(FAST, http_client=client))
        try:
            with pytest.raises(Unreachable) as caught:
                await source.stat(f"{https_nginx.url}/a.tar")
        finally:
            await source.aclose()
        return str(caught.value)

    # Unreachable both ways (a first contact that fails to connect); h1's message names why.
    assert "CERTIFICATE_VERIFY_FAILED" in trio.run(fails, "auto")
    assert "cannot connect" in trio.run(fails, "httpx")


def test_https_connections_a_restart_closed_are_replaced(https_nginx: Nginx) -> None:
    data = put(https_nginx.root, "a.tar")

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{https_nginx.url}/a.tar")
        assert await read(source, shard, 0, SIZE) == data
        https_nginx.restart()  # the kept-alive TLS connection is closed under us
        assert await read(source, shard, 5, 600_000) == data[5:600_000]
        assert pool(source).opened == 2 and source.stats.errors == 0

    with_http(check)


def test_a_connection_idle_too_long_is_not_reused(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{nginx.url}/a.tar")
        h1 = pool(source)
        assert await read(source, shard, 0, 1000) == data[:1000]
        assert h1.opened == 1  # the stat's connection carried the read
        h1.keep_idle_s = 0.0  # every idle connection is now too old to trust
        assert await read(source, shard, 1000, 2000) == data[1000:2000]
        assert (h1.sent, h1.opened) == (3, 2)

    with_http(check)


@contextlib.contextmanager
def recording_server(body: bytes, etags: list[bytes]) -> Iterator[tuple[str, list[bytes]]]:
    """Answers every GET of a kept-alive connection with a Range of `body`, its ETag the next
    of `etags` (the last one repeated), two Cache-Control lines (a repeated header), and
    records each request's head. Yields the URL and the heads received."""
    heads: list[bytes] = []

    def serve(conn: socket.socket) -> None:
        with conn:
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                heads.append(head + b"\r\n\r\n")
                span = next(line for line in head.decode("latin-1").split("\r\n")
                            if line.lower().startswith("range"))
                start, end = (int(x) for x in span.split("=")[1].split("-"))
                piece = body[start : end + 1]
                etag = etags[min(len(heads), len(etags)) - 1]
                conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n"
                             b"Content-Range: bytes %d-%d/%d\r\nETag: %s\r\n"
                             b"Cache-Control: no-transform\r\ncache-control: max-age=1\r\n\r\n%s"
                             % (len(piece), start, end, len(body), etag, piece))

    with serving(serve) as (url, _):
        yield url, heads


def counting_builds(monkeypatch: pytest.MonkeyPatch, cls: type[HttpSource]) -> list[int]:
    """Count the httpx.Requests a source class builds from now on (the count's one item)."""
    built = [0]
    build = cls._build_request

    def counting(self: HttpSource, url: str, headers: dict[str, str]):
        built[0] += 1
        return build(self, url, headers)

    monkeypatch.setattr(cls, "_build_request", counting)
    return built


def test_plain_gets_go_as_bytes_made_once_per_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain GET is not built as an httpx.Request each time: the URL's request line and
    headers are made once (from the request httpx would build) and each GET adds its Range
    and validator. What the server receives is byte for byte what the httpx.Request would
    have been, and the answer's headers are read as httpx's (ETag checked, a repeated header
    joined)."""
    from shardfs.sources.base import ShardChanged
    from shardfs.sources.h1 import Answer, _request_head
    from shardfs.sources.http import _range_headers

    body = bytes(range(256)) * 400
    built = counting_builds(monkeypatch, HttpSource)
    spans = [(0, 3000), (5000, 9000), (20000, 20001), (99_000, 102_400)]
    with recording_server(body, [b'"v1"'] * (len(spans) + 1) + [b'"v2"']) as (url, heads):

        async def check(source: HttpSource) -> None:
            shard = await source.stat(url)
            assert shard.etag == '"v1"'
            answers: list[object] = []
            send = pool(source).get

            async def get(*args):
                answers.append(answer := await send(*args))
                return answer

            monkeypatch.setattr(pool(source), "get", get)
            for start, end in spans:
                assert await read(source, shard, start, end) == body[start:end]
            assert built[0] == 1  # the URL's head, made at the stat's GET
            assert source.stats.httpx_requests == 0
            assert len(answers) == len(spans) and all(isinstance(a, Answer) for a in answers)
            assert answers[0].headers["cache-control"] == "no-transform, max-age=1"
            for (start, end), head in zip(spans, heads[1:], strict=True):
                assert head == _request_head(source._build_request(url, _range_headers(
                    shard, start, end)))
            assert b"\r\nIf-Match: \"v1\"\r\n" in heads[-1] and b"Range: bytes=" in heads[-1]
            with pytest.raises(ShardChanged, match="ETag"):  # the server's now says "v2"
                await read(source, shard, 0, 10)

        with_http(check)


def test_signed_s3_gets_go_as_the_signed_requests_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 GETs take the same way: the object's request head is made once, and each GET adds
    its Range, validator and SigV4 headers, byte for byte those of the signed httpx.Request
    (the clock fixed, so both carry the same signature); with a session token too."""
    from shardfs.sources import sigv4
    from shardfs.sources.h1 import _request_head
    from shardfs.sources.http import _range_headers
    from shardfs.sources.s3 import S3Config, S3Source

    monkeypatch.setattr(sigv4, "amz_date", lambda now=None: "20261127T003000Z")
    body = bytes(range(256)) * 400
    spans = [(0, 3000), (5000, 9000), (99_000, 102_400)]
    creds = sigv4.Credentials("AKIDEXAMPLE", "secret", session_token="token", source="test")
    with recording_server(body, [b'"v1"']) as (url, heads):
        endpoint = url.rsplit("/", 1)[0]
        source = S3Source(FAST, config=S3Config(endpoint=endpoint, addressing="path",
                                                credentials=creds))

        async def check() -> None:
            try:
                shard = await source.stat("s3://bucket/a.tar")
                built = counting_builds(monkeypatch, S3Source)
                for start, end in spans:
                    assert await read(source, shard, start, end) == body[start:end]
                assert built[0] == 0  # no httpx.Request per GET
                for (start, end), head in zip(spans, heads[1:], strict=True):
                    assert head == _request_head(source._build_request(
                        "s3://bucket/a.tar", _range_headers(shard, start, end)))
                assert b"\r\nx-amz-security-token: token\r\n" in heads[-1]
                assert b"\r\nauthorization: AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/" in heads[-1]
            finally:
                await source.aclose()

        trio.run(check)


def test_gcs_gets_carry_the_bearer_token_as_the_httpx_request_did(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GCS (the XML API with an OAuth token) takes the same way: the bearer token is added
    last, where the httpx.Request put it."""
    from shardfs.sources.gs import GsSource
    from shardfs.sources.h1 import _request_head
    from shardfs.sources.http import _range_headers

    for name in ("GS_ACCESS_KEY_ID", "GS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS",
                 "CLOUDSDK_CONFIG", "GCE_METADATA_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", "ya29.token")
    body = bytes(range(256)) * 400
    with recording_server(body, [b'"v1"']) as (url, heads):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url.rsplit("/", 1)[0])
        source = GsSource(FAST)

        async def check() -> None:
            try:
                shard = await source.stat("gs://bucket/a.tar")
                built = counting_builds(monkeypatch, GsSource)
                assert await read(source, shard, 5000, 9000) == body[5000:9000]
                assert built[0] == 0  # no httpx.Request per GET
                assert heads[-1] == _request_head(source._build_request(
                    "gs://bucket/a.tar", _range_headers(shard, 5000, 9000)))
                assert heads[-1].endswith(b"\r\nAuthorization: Bearer ya29.token\r\n\r\n")
            finally:
                await source.aclose()

        trio.run(check)


def test_a_mount_over_plain_http_splices_its_downloads_into_the_cache(
        nginx: Nginx, mounter: Mounter, tmp_path: Path) -> None:
    """Through a real mount: the shards' whole downloads go from the socket into the cache
    files (splice), counted in the stats, and every file reads right. Shards of ~2.5 MB:
    what comes with an answer's head is written by pwrite, and a download's head is read
    alone (at most SPLICED_HEAD_RECEIVE bytes: read with 1 MiB, ~1 MiB of each shard went
    through Python)."""
    root = tmp_path / "tree"
    make_imagefolder(root, classes=2, per_class=40, mean_kb=64, seed=5)
    packed = pack(root, tmp_path / "shards", prefix="train", shard_size=5 << 19, seed=6)
    ds = Dataset(root, packed, tmp_path / "shards")
    publish(ds, nginx.root)
    m = mounter.mount([brace(ds, f"{nginx.url}/data")], None, None, "--no-warm")
    for rel, data in ds.files().items():
        assert (m.mountpoint / rel).read_bytes() == data
    shards = len(packed.shards)
    deadline = time.monotonic() + 30
    while m.stats()["shards_cached"] < shards and time.monotonic() < deadline:
        time.sleep(0.05)  # the last shard's check and commit follow its last bytes
    stats = m.stats()
    assert stats["shards_cached"] == shards >= 2, stats
    source, shard_bytes = stats["source"], stats["reader"]["shard_bytes"]
    unspliced = shard_bytes - source["spliced_bytes"]
    assert 0 <= unspliced <= source["requests"] * SPLICED_HEAD_RECEIVE, source


def test_a_mount_behind_a_proxy_says_its_gets_go_through_httpx(
        dataset: Dataset, nginx: Nginx, mounter: Mounter,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With http_proxy set, h1 steps aside (httpx sends through the proxy): the log says so
    once, and the stats count those GETs (`httpx_requests`, and `shardfs stats`)."""
    for name in ("no_proxy", "NO_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    publish(dataset, nginx.root)
    with FaultProxy(nginx.port) as proxy:  # forwards bytes: nginx reads absolute-form GETs
        monkeypatch.setenv("http_proxy", proxy.url)
        m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm")
        rel = next(iter(dataset.files()))
        assert (m.mountpoint / rel).read_bytes() == (dataset.root / rel).read_bytes()
        source = m.stats()["source"]
        assert source["httpx_requests"] == source["requests"] > 0, source
        assert proxy.requests, "nothing went through the proxy"
        human = subprocess.run([*SHARDFS, "stats", str(m.mountpoint)], capture_output=True,
                               text=True, check=True).stdout
        assert " through httpx" in human, human
        assert m.log().count("a proxy is set in the environment") == 1, m.log()


BIG_BODY = 6 << 20  # long enough for a queue to build and a few looks at it


def _capped_nginx_port(nginx: Nginx, rate: str) -> PortCap:
    if shutil.which("tc") is None:
        pytest.skip("tc not installed (iproute2)")
    return PortCap(nginx.port, rate, burst="256kb")  # a queue from the first bytes


def test_a_small_window_get_is_capped_where_a_queue_stands(nginx: Nginx) -> None:
    """A GET that asks for small windows (a download in the cold start: window.SMALL_WINDOW)
    over a link that queues its bytes (nginx's replies through a real tbf on lo) has its
    connection's receive buffer capped while its body arrives; the origin's window is
    known from then on, and the next such GET goes over a connection opened with it. GETs
    that do not ask never take a capped connection. The bytes are the file's throughout."""
    from shardfs.sources.window import MIN_WINDOW, SMALL_WINDOW

    data = put(nginx.root, "big.tar", BIG_BODY)

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"http://127.0.0.1:{nginx.port}/big.tar")
        h1 = pool(source)
        (origin,) = h1.rtt  # measured on the connection the stat opened
        token = SMALL_WINDOW.set(True)
        try:
            assert await read(source, shard) == data
        finally:
            SMALL_WINDOW.reset(token)
        assert source.stats.small_window_connections == 1, h1.windows
        window = h1.windows[origin]
        assert MIN_WINDOW <= window < 1 << 20, window  # ~0.5 ms of 25 MB/s, or the floor
        (capped,) = [c for c in h1._idle[origin] if c.window is not None]
        assert capped.window == window
        # Locked (no autotuning): what the kernel keeps is twice what it was asked for.
        kept = capped.socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert kept >= 2 * window, (kept, window)
        # The stat's connection carried the download (and was capped): a GET that does not
        # ask opens another rather than take it.
        opened = h1.opened
        assert await read(source, shard, 1000, 5000) == data[1000:5000]
        idle = h1._idle[origin]
        assert idle[-1].window is None and capped in idle and h1.opened == opened + 1, idle
        opened = h1.opened
        idle.remove(capped)
        await capped.aclose()
        token = SMALL_WINDOW.set(True)
        try:
            assert await read(source, shard, 7, 2_000_000) == data[7:2_000_000]
        finally:
            SMALL_WINDOW.reset(token)
        (small,) = [c for c in h1._idle[origin] if c.window is not None]
        assert h1.opened == opened + 1 and small.window == window
        assert small.socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * window
        assert source.stats.small_window_connections == 2

    with _capped_nginx_port(nginx, "200mbit") as cap:
        if not cap.active:
            pytest.skip(f"no cap on lo here: {cap.error}")
        with_http(check)


@pytest.mark.parametrize("receiver", ["thread", "loop"])
def test_a_small_window_download_spliced_into_a_file_is_capped_too(
        nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, receiver: str) -> None:
    """A download's body spliced into its file (stream_into) by the thread of C, or by the
    loop: where it asks for small windows and a queue stands, its connection is capped as
    the body arrives (the loop looks at each of the thread's reports), the file exact."""
    from shardfs.sources import h1 as h1_module
    from shardfs.sources.window import MIN_WINDOW, SMALL_WINDOW

    if receiver == "thread":
        assert h1_module._bodysplice is not None, "shardfs/sources/_bodysplice.c is not built"
    monkeypatch.setattr(h1_module, "BODIES_BY_THREAD", receiver == "thread")
    data = put(nginx.root, "big.tar", BIG_BODY)
    target = tmp_path / "part"
    target.write_bytes(bytes(BIG_BODY))

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"http://127.0.0.1:{nginx.port}/big.tar")
        h1 = pool(source)
        (origin,) = h1.rtt
        token = SMALL_WINDOW.set(True)
        fd = os.open(target, os.O_RDWR)
        try:
            await read_into(source, shard, fd, 0, BIG_BODY, data)
        finally:
            os.close(fd)
            SMALL_WINDOW.reset(token)
        assert source.stats.spliced_bytes > BIG_BODY // 2
        assert source.stats.small_window_connections == 1, h1.windows
        assert MIN_WINDOW <= h1.windows[origin] < 1 << 20, h1.windows

    with _capped_nginx_port(nginx, "200mbit") as cap:
        if not cap.active:
            pytest.skip(f"no cap on lo here: {cap.error}")
        with_http(check)
    assert target.read_bytes() == data


def test_a_small_window_get_without_a_queue_keeps_its_window(nginx: Nginx) -> None:
    """Over plain loopback (no queue on the way: the link faster than the reader), a GET
    that asks for small windows is not capped: a window there would only slow it."""
    from shardfs.sources.window import SMALL_WINDOW

    data = put(nginx.root, "big.tar", BIG_BODY)

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"http://127.0.0.1:{nginx.port}/big.tar")
        token = SMALL_WINDOW.set(True)
        try:
            for _ in range(3):
                assert await read(source, shard) == data
        finally:
            SMALL_WINDOW.reset(token)
        h1 = pool(source)
        assert source.stats.small_window_connections == 0 and h1.windows == {}
        assert all(c.window is None for c in h1._idle[next(iter(h1.rtt))])

    with_http(check)


def test_a_cap_is_sized_from_the_rate_and_left_off_far_links() -> None:
    """Half a millisecond of the download's rate plus two base round trips, at least 32 KiB;
    none where the kernel would not give it (a far link, where a small window would throttle
    the download). A connection capped while it receives keeps room for one and a quarter
    of its segments. The kernel's TCP_INFO gives a loopback connection's round trips."""
    from shardfs.sources.window import handshake_rtt, live_cap, rate_window, receive_rtt

    limit = 212_992
    assert rate_window(10e6, 10e-6, limit) == 32 << 10  # the floor
    assert rate_window(100e6, 10e-6, limit) == 52_000
    assert rate_window(100e6, 0.05, limit) is None  # 10 MB: more than rmem_max
    assert rate_window(100e6, 0.05, 256 << 20) == 10_050_000  # where rmem_max is raised
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        rtt = handshake_rtt(client)
        assert rtt is not None and 0 < rtt < 0.1, rtt
        conn, _ = server.accept()
        with conn:
            sender = threading.Thread(target=conn.sendall, args=(b"x" * (4 << 20),))
            sender.start()
            got = 0
            while got < 4 << 20:
                got += len(client.recv(1 << 20))
            sender.join()
        received = receive_rtt(client)
        assert received is None or 0 < received < 1.0, received
        # loopback's segments are ~64 KiB: more than the floor; a larger cap is kept
        assert live_cap(client, 32 << 10) > 32 << 10
        assert live_cap(client, 1 << 20) == 1 << 20


def test_the_serving_loop_takes_over_the_indexing_loops_round_trips(nginx: Nginx) -> None:
    """The daemon indexes with one HttpSource and serves with the next (`take_over`): the
    round trips the first measured are what the second sees queues above, even before it
    opened a connection of its own."""
    put(nginx.root, "a.tar")
    url = f"http://127.0.0.1:{nginx.port}/a.tar"

    async def main() -> None:
        indexing = HttpSource(FAST)
        try:
            await indexing.stat(url)
        finally:
            await indexing.aclose()
        serving = HttpSource(FAST)
        serving.take_over(indexing)
        try:
            assert pool(serving).rtt == pool(indexing).rtt != {}
            assert pool(serving).opened == 0
        finally:
            await serving.aclose()

    trio.run(main)


def test_bytes_waiting_in_a_plain_connection_are_read_directly_and_the_loop_still_runs() -> None:
    """A plain connection's receive takes bytes already in the socket without a trip through
    the loop (no wait, no timeout scope), and lets the loop's other tasks run once per
    CHECKPOINT_BYTES: 16 MiB already in the receive queue, read in 256 KiB receives, let a
    ticking task run at least once per MiB (none without the checkpoints)."""
    if os.geteuid() != 0:
        pytest.skip("SO_RCVBUFFORCE needs root (to hold 16 MiB in one receive queue)")
    from shardfs.sources.h1 import CHECKPOINT_BYTES, _Connection

    so_sndbufforce, so_rcvbufforce = 32, 33  # Linux's; not in Python's socket module
    size = 16 << 20
    payload = os.urandom(size)
    listener = socket.create_server(("127.0.0.1", 0))
    sent = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, so_sndbufforce, 64 << 20)
            conn.sendall(payload)
            sent.set()
            conn.recv(1)  # until the client closes

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    async def main() -> None:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, so_rcvbufforce, 64 << 20)
        await sock.connect(listener.getsockname())
        conn = _Connection(trio.SocketStream(sock), sock)
        assert conn.fd == sock.fileno()
        h1 = Http11Pool(max_connections=1, timeout=10.0)
        await trio.to_thread.run_sync(sent.wait, 10.0)
        for _ in range(100):  # until every byte is in our receive queue
            waiting = array("i", [0])
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting)
            if waiting[0] == size:
                break
            await trio.sleep(0.02)
        assert waiting[0] == size
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0)
                ticks += 1

        got = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.01)
            before = ticks
            while len(got) < size:
                got += await h1.receive(conn, 256 << 10)
            ran = ticks - before
            nursery.cancel_scope.cancel()
        assert bytes(got) == payload
        assert CHECKPOINT_BYTES <= 1 << 20
        assert ran >= (size >> 20) - 1, ran  # once per MiB at least; without checkpoints: 0
        await conn.aclose()

    try:
        trio.run(main)
    finally:
        listener.close()
        server.join(10)


def test_an_address_that_does_not_answer_is_left_for_the_next(
        nginx: Nginx, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name with two addresses, the first a listener whose queue is full (its SYNs
    are dropped: it never answers): the connection goes to the second after CONNECT_TRY_S,
    within the GET's own timeout, and the bytes are right."""
    from shardfs.sources.h1 import CONNECT_TRY_S

    data = put(nginx.root, "a.tar")
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    fillers = []
    try:
        for _ in range(3):  # fill its accept queue: later SYNs are dropped
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(hole.getsockname())
            fillers.append(filler)
        time.sleep(0.1)
        probe = socket.socket()
        probe.settimeout(CONNECT_TRY_S)
        with pytest.raises(OSError):  # (TimeoutError) it does not answer
            probe.connect(hole.getsockname())
        probe.close()
        real = trio.socket.getaddrinfo

        async def two_addresses(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
            if host == "twice.test":
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", hole.getsockname()),
                        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
            return await real(host, port, *args, **kwargs)

        monkeypatch.setattr(trio.socket, "getaddrinfo", two_addresses)
        settings = dataclasses.replace(FAST, timeout=CONNECT_TRY_S * 6)

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"http://twice.test:{nginx.port}/a.tar")
            assert await read(source, shard, 1000, 5000) == data[1000:5000]
            assert source.stats.retries == 0  # no timeout: the second address answered

        with_http(check, settings)
    finally:
        for filler in fillers:
            filler.close()
        hole.close()


def test_a_request_written_to_a_reset_connection_is_unanswered() -> None:
    """A kept-alive connection the server reset after `stale` looked at it: the request's
    direct write fails (EPIPE / ECONNRESET) and that is the pool's "closed as it was reused"
    case (`_Unanswered`, sent again on a new connection), not an OSError out of the GET."""
    from shardfs.sources.h1 import _Connection, _Unanswered

    listener = socket.create_server(("127.0.0.1", 0))
    connected = threading.Event()  # reset only once the client's connect has returned (an
    # RST before it reads SO_ERROR fails the connect itself: seen once in CI)

    def reset() -> None:
        conn, _ = listener.accept()
        connected.wait(10)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()  # with a zero linger: an RST

    server = threading.Thread(target=reset, daemon=True)
    server.start()

    async def main() -> None:
        sock = trio.socket.socket()
        await sock.connect(listener.getsockname())
        connected.set()
        await trio.to_thread.run_sync(server.join, 10.0)
        await trio.sleep(0.05)  # the RST has arrived
        conn = _Connection(trio.SocketStream(sock), sock)
        h1 = Http11Pool(max_connections=1, timeout=5.0)
        with pytest.raises(_Unanswered):
            await h1._exchange(("http", "127.0.0.1", 80), conn, b"GET / HTTP/1.1\r\n\r\n")
        await conn.aclose()

    try:
        trio.run(main)
    finally:
        listener.close()
