"""A lean HTTP/1.1 GET for http:// and https:// origins, beside httpx.

Why: a ranged GET of a 110 KB member cost 1.5-2.9 ms of CPU through httpx's client, httpcore's
pool and h11 on this project's 2-core machine, against ~0.13-0.27 ms for the same request
written and parsed here (docs/benchmarks-notes.md, "A GET's CPU"). A cold epoch through
`Lookahead` makes one GET per file, so that cost was most of the daemon's CPU.

What it does: sends a request that httpx built (`httpx.Request`: URL, headers, signatures all
as before), over a kept-alive connection of its own pool, and returns an `httpx.Response`
whose body streams from that connection. Callers see the same types and the same
exceptions (httpx's `ConnectError`, `ReadError`, `RemoteProtocolError`, `ReadTimeout`, ...),
so HttpSource's retries, validation and messages apply unchanged. Most GETs skip even those
objects (http(s)://, S3, GCS and AIStore objects; HttpSource._head): `RequestHead` keeps a
URL's request line and fixed headers as bytes, made once from the httpx.Request, to which
each GET appends its own (Range, a validator, a signature), and `get` returns an `Answer`
(status, reason, headers by lower-case name, the raw body): ~240 instead of ~450 µs of CPU
per ranged GET of 110 KiB on 2 cores.

https is TLS over the same connections, with the context httpx would make
(`httpx.create_ssl_context()`: the same CA bundle, SSL_CERT_FILE / SSL_CERT_DIR), through the
ssl module's memory BIOs (`_TlsStream`): each receive decrypts every TLS record that has
arrived, where trio's SSLStream (which httpcore uses) returns one 16 KiB record per receive,
5-9 CPU s per GB on this machine. What it leaves to httpx (`HttpSource` sends those there):
proxies from the environment, and any answer this module does not read itself: a redirect,
a body without Content-Length (chunked), an interim 1xx, folded header lines. Such an
answer closes the connection, marks the origin, and the same GET (idempotent) is sent again
through httpx; the origin's later requests go to httpx directly.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import select
import ssl
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar

import httpx
import trio

from shardfs.sources.addresses import Addresses, AddressInfo
from shardfs.sources.base import SourceStats
from shardfs.sources.window import (
    SMALL_WINDOW,
    QueueWatch,
    handshake_rtt,
    live_cap,
    rmem_max,
)
from shardfs.util.fileio import pwrite_all

try:  # optional (setup.py): without it the loop's thread splices bodies itself
    from shardfs.sources import _bodysplice
except ImportError:
    _bodysplice = None

HEAD_LIMIT = 64 << 10  # a response's status line and headers; more is a protocol error
RECEIVE_BYTES = 1 << 20  # most bytes asked of one receive (a receive returns what arrived)
# The most bytes a head's receive asks for while SPLICED_BODIES is set: a head is a
# few hundred bytes, and what comes with it is body that then passes through Python (copied
# twice, written by `pwrite`) instead of being spliced: up to 1 MiB a download otherwise.
SPLICED_HEAD_RECEIVE = 4 << 10
# Set (True) around the sending of a GET whose body will go into a file by
# `_Body.splice_into` (HttpSource's `stream_into`: a whole-shard download).
SPLICED_BODIES: ContextVar[bool] = ContextVar("shardfs_spliced_bodies", default=False)
# A plain connection's receives that find bytes waiting do not pass through the event loop
# (Http11Pool.receive); one in this many bytes received lets the loop's other tasks run.
CHECKPOINT_BYTES = 1 << 20
CONNECT_TRY_S = 0.5  # an address that has not answered in this long: the next one is tried
SPLICE_PIPE_BYTES = 1 << 20  # the pipe a body is spliced through (the most one step moves)
# Spliced bodies are received by a thread of C where _bodysplice is built: the splices off the
# loop's thread (docs/sources.md). SHARDFS_BODIES_BY_THREAD=0 keeps them on it, to measure.
BODIES_BY_THREAD = os.environ.get("SHARDFS_BODIES_BY_THREAD", "1") != "0"
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                   "ALL_PROXY")

Origin = tuple[str, str, int]  # scheme, host, port
Headers = list[tuple[bytes, bytes]]


class _Unanswered(Exception):
    """The connection failed before any byte of the answer: on a kept-alive connection,
    the server closed it as the request went out, and a fresh one may carry the GET."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


class NotForUs(Exception):
    """The answer is one this module does not read (see the module's docstring): send the
    request through httpx instead."""


def proxy_in_environment() -> bool:
    """True when httpx would send requests through a proxy (it reads these variables by
    default); this module never does, so it stays out of the way."""
    return any(os.environ.get(name) for name in PROXY_VARIABLES)


class _TlsStream:
    """TLS over a trio TCP stream (client side), receiving as many records as have arrived.

    The same duties as trio.SSLStream for one request at a time: handshake, `send_all`,
    `receive_some` (b"" at the end: close_notify or, as browsers and trio's
    https_compatible mode allow, a bare TCP close) and a forceful close. Transport failures
    surface as trio.BrokenResourceError, as from a TCP stream; TLS failures as ssl.SSLError."""

    def __init__(self, tcp: trio.SocketStream, context: ssl.SSLContext, host: str) -> None:
        self.tcp = tcp
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)

    async def do_handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill(1 << 16):
                    raise trio.BrokenResourceError(
                        "connection closed during the TLS handshake") from None
                continue
            await self._flush()
            return

    async def send_all(self, data: bytes) -> None:
        self._tls.write(data)
        await self._flush()

    async def receive_some(self, max_bytes: int) -> bytes:
        parts: list[bytes] = []
        got = 0
        while True:
            try:
                while got < max_bytes:
                    piece = self._tls.read(max_bytes - got)
                    parts.append(piece)
                    got += len(piece)
                return b"".join(parts)
            except ssl.SSLWantReadError:
                if parts:
                    return b"".join(parts)
                await self._flush()  # what reading produced (a key update's answer)
                await self._fill(max_bytes)  # at EOF the next read raises, below
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b"".join(parts)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.tcp)

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            await self.tcp.send_all(data)

    async def _fill(self, size: int) -> bool:
        data = await self.tcp.receive_some(max(size, 1 << 16))
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True


class _Connection:
    """One kept-alive TCP connection to an origin."""

    __slots__ = ("buffer", "fd", "idle_since", "socket", "stream", "unyielded", "window")

    def __init__(self, stream: trio.SocketStream | _TlsStream,
                 sock: trio.socket.SocketType, window: int | None = None) -> None:
        self.stream = stream
        self.socket = sock
        # Plain TCP: the socket's descriptor, read and written directly while it is ready
        # (Http11Pool.receive, _exchange); -1 for TLS, whose bytes go through its stream.
        self.fd = sock.fileno() if isinstance(stream, trio.SocketStream) else -1
        self.unyielded = 0  # bytes received since the loop last ran other tasks
        # Bytes received past the end of what was read (the head's receive takes some of
        # the body with it): immutable, so the body takes them without a copy.
        self.buffer = b""
        self.idle_since = 0.0
        # The receive buffer it was opened with or capped at (window.py); None: the
        # kernel's autotuning.
        self.window = window

    def take(self, most: int) -> bytes:
        """Up to `most` of the bytes received past what was read (no copy when all go)."""
        buffer = self.buffer
        piece = buffer if len(buffer) <= most else buffer[:most]
        self.buffer = buffer[len(piece):]
        return piece

    def stale(self, now: float, keep_idle_s: float) -> bool:
        """True if the connection must not carry another request: idle too long, bytes
        waiting that nobody asked for, or the server closed it (readable at EOF)."""
        if self.buffer or now - self.idle_since > keep_idle_s:
            return True
        poller = select.poll()
        poller.register(self.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


def _splice_out(pool: Http11Pool, pipe: int, into: int, count: int, at: int) -> int:
    """Move `count` bytes from the pipe into the file `into` at offset `at`; returns how
    many of them were spliced (the rest were copied); OSError (ENOSPC where the file system
    took fewer bytes without saying why). A file that takes no splice write (EINVAL: a file
    system without it) gets the pipe's bytes by `pwrite`, and the pool splices no more
    bodies."""
    total = count
    while count and pool.splice_writes:
        try:
            n = os.splice(pipe, into, count, offset_dst=at)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            pool.splice_writes = False
            break
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        count -= n
        at += n
    unspliced = count
    while count:  # they are in the pipe
        data = os.read(pipe, count)
        pwrite_all(into, data, at)
        count -= len(data)
        at += len(data)
    return total - unspliced


def _ended_early(left: int) -> httpx.RemoteProtocolError:
    return httpx.RemoteProtocolError(
        f"server closed the connection with {left} bytes of the body still to come")


def _raise_for(state: int, err: int, left: int, timeout: float) -> None:
    """The exception `_Body.splice_into`'s loop would have raised for how a thread of C
    ended (`_bodysplice`'s states); nothing for a body received to its end."""
    assert _bodysplice is not None
    if state == _bodysplice.DONE:
        return
    if state == _bodysplice.EOF:
        raise _ended_early(left)
    if state == _bodysplice.TIMEOUT:
        raise httpx.ReadTimeout(f"no bytes for {timeout:g} s")
    if state == _bodysplice.SOCKET_ERROR:
        raise httpx.ReadError(os.strerror(err))
    if state == _bodysplice.FILE_ERROR:
        raise OSError(err, os.strerror(err))
    raise AssertionError(f"a body's thread ended in state {state}")  # STOPPED: only by us


class _Body(httpx.AsyncByteStream):
    """A response's body: `length` bytes from the connection; the connection goes back to
    the pool when the body was read to its end, and is closed otherwise."""

    def __init__(self, pool: Http11Pool, origin: Origin, conn: _Connection,
                 length: int, reusable: bool, watch: QueueWatch | None = None) -> None:
        self._pool = pool
        self._origin = origin
        self._conn: _Connection | None = conn
        self._left = length
        self._reusable = reusable
        self._watch = watch  # looks for a queue the connection's window should be capped for

    def _look(self, conn: _Connection, count: int) -> None:
        assert self._watch is not None
        window = self._watch.received(count)
        if window is not None:
            self._watch = None
            self._pool.cap(self._origin, conn, window)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        if conn.buffer and self._left:
            piece = conn.take(self._left)
            self._left -= len(piece)
            yield piece
        while self._left:
            data = await self._pool.receive(conn, min(self._left, RECEIVE_BYTES))
            if not data:
                raise _ended_early(self._left)
            # Never more than asked: bytes a server writes past its Content-Length stay in
            # the socket, which makes the connection stale (not reused).
            self._left -= len(data)
            if self._watch is not None:
                self._look(conn, len(data))
            yield data

    def can_splice(self) -> bool:
        """Whether splice_into can take the body: a plain TCP connection (TLS bytes must be
        decrypted in Python)."""
        conn = self._conn
        return (self._pool.splice_writes and conn is not None
                and isinstance(conn.stream, trio.SocketStream))

    def splice_into(self, into: int, at: int,
                    count: int) -> AsyncIterator[tuple[int, int]]:
        """Write the body's next `count` bytes (at most what is left of it) into the file
        `into` from offset `at`, yielding each piece's length once it is written, and how
        many of its bytes were spliced: from the socket through a pipe into the file's page
        cache (splice(2)), never copied into Python, which halves what the loop's thread
        copies per byte of a download (docs/sources.md). Where the C module is built, a
        thread of its own does the splices and the loop only hears of the pieces
        (`_bodysplice.c`); else the loop splices. A write that fails raises its OSError;
        the connection's failures raise as `receive`'s do. Plain TCP only (can_splice)."""
        if _bodysplice is not None and BODIES_BY_THREAD:
            return self._splice_by_thread(into, at, count)
        return self._splice_in_loop(into, at, count)

    def _head_bytes_into(self, conn: _Connection, into: int, at: int, count: int) -> int:
        """The bytes that came with the headers (at most `count`) written into `into` at
        `at`; how many."""
        if not conn.buffer or not count:
            return 0
        piece = conn.take(count)
        pwrite_all(into, piece, at)
        self._left -= len(piece)
        return len(piece)

    async def _splice_by_thread(self, into: int, at: int,
                                count: int) -> AsyncIterator[tuple[int, int]]:
        conn = self._conn
        assert conn is not None and self.can_splice() and _bodysplice is not None
        count = min(count, self._left)
        head = self._head_bytes_into(conn, into, at, count)
        if head:
            yield head, 0
        count -= head
        if not count:
            return
        timeout_ms = int(min(self._pool.timeout, 86400.0) * 1000)
        receiver = _bodysplice.start(conn.socket.fileno(), into, at + head, count,
                                     timeout_ms, SPLICE_PIPE_BYTES)
        told = told_spliced = 0
        try:
            while True:
                await trio.lowlevel.wait_readable(receiver.fileno())
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(receiver.fileno())
                written, spliced, state, err = receiver.progress()
                if written > told:
                    n, spliced_n = written - told, spliced - told_spliced
                    told, told_spliced = written, spliced
                    self._left -= n
                    if spliced_n < n:  # the file took no splice write: bodies come as bytes
                        self._pool.splice_writes = False
                    if self._watch is not None:  # the connection's queue, as the loop's
                        self._look(conn, n)  # splices look at it (a cap applies at once)
                    yield n, spliced_n
                if state != _bodysplice.RUNNING:
                    break
            _raise_for(state, err, self._left, self._pool.timeout)
        finally:
            receiver.stop()

    async def _splice_in_loop(self, into: int, at: int,
                              count: int) -> AsyncIterator[tuple[int, int]]:
        conn = self._conn
        assert conn is not None and self.can_splice()
        count = min(count, self._left)
        head = self._head_bytes_into(conn, into, at, count)
        if head:
            yield head, 0
        count -= head
        at += head
        if not count:
            return
        pipe_out, pipe_in = os.pipe2(os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):  # the default (64 KiB) works, in more steps
                fcntl.fcntl(pipe_in, fcntl.F_SETPIPE_SZ, SPLICE_PIPE_BYTES)
            sock = conn.socket.fileno()
            while count:
                try:
                    n = os.splice(sock, pipe_in, min(count, SPLICE_PIPE_BYTES),
                                  flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
                except BlockingIOError:  # nothing arrived yet (the pipe is always empty)
                    await self._pool.wait_readable(conn)
                    continue
                except OSError as e:
                    raise httpx.ReadError(os.strerror(e.errno or 0)) from e
                if n == 0:
                    raise _ended_early(self._left)
                self._left -= n
                count -= n
                if self._watch is not None:
                    self._look(conn, n)
                spliced = _splice_out(self._pool, pipe_out, into, n, at)
                at += n
                yield n, spliced  # (bytes written, of them spliced)
        finally:
            os.close(pipe_out)
            os.close(pipe_in)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._left == 0 and self._reusable and not conn.buffer:
            self._pool.release(self._origin, conn)
        else:
            await self._pool.discard(conn)


_Head = tuple[int, bytes, bytes, Headers, "_Body"]  # status, reason, version, headers, body


class Answer:
    """A response to `Http11Pool.get`: what HttpSource reads of an httpx.Response (status,
    reason, headers by lower-case name, the body as raw pieces), without building one."""

    __slots__ = ("_body", "headers", "is_stream_consumed", "reason_phrase", "sent",
                 "status_code")

    def __init__(self, status: int, reason: bytes, headers: Headers, body: _Body) -> None:
        self.status_code = status
        self.is_stream_consumed = False  # the body's iteration has begun (as httpx says it)
        self.sent: dict[str, str] = {}  # headers of the GET beyond its RequestHead, by
        # lower-case name (HttpSource fills them in: S3 reads the key it signed with)
        self.reason_phrase = reason.decode("latin-1")
        # A repeated header keeps its values joined, as httpx.Headers.get gives them.
        found: dict[str, str] = {}
        for name, value in headers:
            key = name.decode("latin-1").lower()
            text = _decoded(value)
            found[key] = f"{found[key]}, {text}" if key in found else text
        self.headers = found
        self._body = body

    def aiter_raw(self) -> AsyncIterator[bytes]:
        self.is_stream_consumed = True
        return self._body.__aiter__()

    def splice_into(self, into: int, at: int,
                    count: int) -> AsyncIterator[tuple[int, int]] | None:
        """The body's next `count` bytes written into the file `into` from `at`, as
        `_Body.splice_into`; None where the connection cannot (TLS): use aiter_raw."""
        if not self._body.can_splice():
            return None
        self.is_stream_consumed = True
        return self._body.splice_into(into, at, count)

    async def aclose(self) -> None:
        await self._body.aclose()


def _decoded(value: bytes) -> str:
    """A header's value as httpx.Headers gives it (UTF-8 where it is, else Latin-1)."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


class RequestHead:
    """A URL's GET request line and fixed headers, made once from the httpx.Request that
    HttpSource would build (so the same Host, User-Agent, Accept-Encoding, in httpx's order),
    to which each GET adds its own headers (Range, a validator)."""

    __slots__ = ("_prefix", "host", "origin", "path", "url")

    def __init__(self, request: httpx.Request) -> None:
        self.url = request.url
        self.origin = _origin(request.url)
        self.host = request.headers["host"]  # as sent (what a signature covers)
        self.path = request.url.raw_path.decode("ascii")
        self._prefix = _request_head(request)[:-2]  # without the blank line that ends it

    def with_headers(self, headers: dict[str, str]) -> bytes:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        return self._prefix + extra.encode("latin-1") + b"\r\n"


class Http11Pool:
    """Kept-alive connections to http:// and https:// origins, at most `max_connections` in
    use or idle at once, and the GETs sent over them."""

    def __init__(self, max_connections: int, timeout: float, keep_idle_s: float = 5.0,
                 stats: SourceStats | None = None) -> None:
        self.timeout = timeout
        self.stats = stats or SourceStats()
        # Servers close idle connections (nginx after 75 s, S3 after ~20 s); a connection
        # idle longer than this is closed here rather than risked.
        self.keep_idle_s = keep_idle_s
        self._slots = trio.Semaphore(max_connections)
        self._idle: dict[Origin, list[_Connection]] = {}
        self.not_ours: set[Origin] = set()  # origins whose answers go to httpx
        self._tls: ssl.SSLContext | None = None  # made at the first https:// request
        self.opened = 0  # connections opened (for tests and benchmarks)
        self.sent = 0  # requests sent
        # Bodies are spliced into files (_Body.splice_into) until a file refuses a splice
        # write (a file system without it): from then on they come as bytes.
        self.splice_writes = True
        # The shortest handshake round trip seen to each origin (seconds): what a queue is
        # seen above (window.py).
        self.rtt: dict[Origin, float] = {}
        # The window a small-window GET's connection to an origin was capped at, once a
        # queue was seen there: later ones are opened with it.
        self.windows: dict[Origin, int] = {}
        self._rmem_max = rmem_max()
        self.addresses = Addresses()  # resolved once per burst of connections

    def takes(self, request: httpx.Request) -> bool:
        url = request.url
        return (request.method == "GET" and url.scheme in DEFAULT_PORTS
                and not request.content and self.takes_origin(_origin(url)))

    def takes_origin(self, origin: Origin) -> bool:
        """`get` may carry GETs to `origin` (not one whose answers go to httpx)."""
        return origin not in self.not_ours

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send `request` (see `takes`) and return its response, its body still to be read.
        Raises NotForUs for an answer this module does not read (the connection is closed
        and the origin marked), else httpx's transport exceptions."""
        status, reason, version, headers, body = await self._send(
            _origin(request.url), _request_head(request))
        return httpx.Response(status, headers=headers, stream=body, request=request,
                              extensions={"reason_phrase": reason, "http_version": version})

    async def get(self, origin: Origin, head: bytes) -> Answer:
        """Send a GET whose request line and headers are `head` (see `RequestHead`) and
        return its answer as an `Answer`: the same steps and exceptions as `send`, without
        building an httpx.Request or httpx.Response (docs/benchmarks-notes.md, "GETs
        without httpx's objects")."""
        status, reason, _, headers, body = await self._send(origin, head)
        return Answer(status, reason, headers, body)

    def window_for(self, origin: Origin) -> int | None:
        """The receive window this task's GETs to `origin` go with: a small one where the
        task asks for it (window.SMALL_WINDOW) and a queue was seen on the way; None:
        autotuned."""
        if not SMALL_WINDOW.get():
            return None
        return self.windows.get(origin)

    def _watch(self, origin: Origin, conn: _Connection) -> QueueWatch | None:
        """A watch for a queue on an autotuned connection this task's GET went over, where
        the task asks for small windows and the origin's base round trip is known."""
        if conn.window is not None or not SMALL_WINDOW.get():
            return None
        base_rtt = self.rtt.get(origin)
        return None if base_rtt is None else QueueWatch(conn.socket, base_rtt, self._rmem_max)

    def cap(self, origin: Origin, conn: _Connection, window: int) -> None:
        """Cap `conn`'s receive buffer at `window` bytes from now on (a queue was seen while
        its answer arrived: window.py), and open the origin's later small-window
        connections with it. The connection carries no other GET afterwards."""
        try:
            conn.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF,
                                   live_cap(conn.socket, window))
        except OSError:
            return
        conn.window = window
        self.windows[origin] = min(window, self.windows.get(origin, window))
        self.stats.small_window_connections += 1

    async def _send(self, origin: Origin, head: bytes) -> _Head:
        try:  # a free slot is taken without a trip through the loop (the GET waits anyway)
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        conn: _Connection | None = None
        window = self.window_for(origin)
        try:
            conn, reused = await self._connection(origin, window)
            try:
                return await self._exchange(origin, conn, head)
            except _Unanswered as e:
                if not reused:
                    raise e.error from e
                # A kept-alive connection the server closed as we sent: once more, anew.
                await conn.aclose()
                conn = None
                conn = await self._open(origin, window)
                try:
                    return await self._exchange(origin, conn, head)
                except _Unanswered as again:
                    raise again.error from again
        except BaseException as exc:
            if isinstance(exc, NotForUs):
                self.not_ours.add(origin)
            if conn is None:
                self._slots.release()
            else:
                await self.discard(conn)
            raise

    async def _exchange(self, origin: Origin, conn: _Connection, head: bytes) -> _Head:
        sent = 0
        if conn.fd >= 0:  # a request's head fits the socket's buffer: no trip through the loop
            try:
                sent = os.write(conn.fd, head)
            except (BlockingIOError, InterruptedError):
                pass  # send_all below sends it
            except OSError as e:  # (EPIPE, ECONNRESET: a kept-alive connection closed)
                raise _Unanswered(httpx.WriteError(e.strerror or str(e))) from e
        if sent < len(head):
            try:
                with trio.move_on_after(self.timeout) as scope:
                    await conn.stream.send_all(head[sent:])
            except (trio.BrokenResourceError, ssl.SSLError) as e:
                raise _Unanswered(httpx.WriteError(str(e.__cause__ or e))) from e
            if scope.cancelled_caught:
                raise httpx.WriteTimeout(f"sending a request took over {self.timeout:g} s")
        self.sent += 1
        status, reason, version, headers = await self._read_head(conn)
        length, reusable = _body_length(status, version, headers)
        if length is None or 300 <= status < 400 or status < 200:
            raise NotForUs(f"HTTP {status} (a redirect, an interim answer or a body without "
                           "Content-Length): sent again through httpx")
        return status, reason, version, headers, _Body(self, origin, conn, length, reusable,
                                                      self._watch(origin, conn))

    async def _read_head(self, conn: _Connection) -> tuple[int, bytes, bytes, Headers]:
        buffer = conn.buffer
        searched = 0
        while True:
            end = buffer.find(b"\r\n\r\n", max(0, searched - 3))
            if end >= 0:
                break
            if len(buffer) > HEAD_LIMIT:
                raise httpx.RemoteProtocolError("response headers larger than 64 KiB")
            searched = len(buffer)
            try:
                data = await self.receive(
                    conn, SPLICED_HEAD_RECEIVE if SPLICED_BODIES.get() else RECEIVE_BYTES)
            except httpx.ReadError as e:
                if buffer:
                    raise
                raise _Unanswered(e) from e
            if not data:
                closed = httpx.RemoteProtocolError(
                    "server disconnected without sending a response")
                if buffer:
                    raise closed
                raise _Unanswered(closed)
            buffer = buffer + data if buffer else data  # (a head in one receive: no copy)
        lines = buffer[:end].split(b"\r\n")
        conn.buffer = buffer[end + 4:]  # the body's first bytes: one copy
        version, _, rest = lines[0].partition(b" ")
        code, _, reason = rest.partition(b" ")
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or not code.isdigit():
            raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        headers = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or line[:1] in (b" ", b"\t"):
                raise NotForUs("a header line this module does not read")
            headers.append((name.strip(), value.strip()))
        return int(code), reason, version, headers

    async def wait_readable(self, conn: _Connection) -> None:
        """Until the connection has bytes (or is closed); httpx.ReadTimeout after `timeout`."""
        with trio.move_on_after(self.timeout) as scope:
            await trio.lowlevel.wait_readable(conn.socket)
            return
        assert scope.cancelled_caught
        raise httpx.ReadTimeout(f"no bytes for {self.timeout:g} s")

    async def receive(self, conn: _Connection, size: int) -> bytes:
        """Up to `size` bytes: those that have arrived, else the first to arrive; b"" at the
        end of the stream. httpx.ReadError / ReadTimeout (no byte for `timeout`).

        A plain connection is read directly (os.read of its descriptor): where bytes wait,
        no timeout scope and no trip through trio's socket wrapper and the loop (a sixth of
        a member GET's CPU where answers arrive in pieces: docs/benchmarks-notes.md, "A
        GET's receives without the loop"); only a receive that finds nothing waits, with
        the timeout. Every CHECKPOINT_BYTES the loop runs its other tasks, and
        cancellation is checked."""
        if conn.fd >= 0:
            while True:
                try:
                    data = os.read(conn.fd, size)
                except (BlockingIOError, InterruptedError):
                    await self.wait_readable(conn)
                    conn.unyielded = 0
                    continue
                except OSError as e:
                    raise httpx.ReadError(e.strerror or str(e)) from e
                conn.unyielded += len(data)
                if conn.unyielded >= CHECKPOINT_BYTES:
                    conn.unyielded = 0
                    await trio.lowlevel.checkpoint()
                return data
        with trio.move_on_after(self.timeout) as scope:
            try:
                return await conn.stream.receive_some(size)
            except (trio.BrokenResourceError, ssl.SSLError) as e:
                raise httpx.ReadError(str(e.__cause__ or e)) from e
        assert scope.cancelled_caught
        raise httpx.ReadTimeout(f"no bytes for {self.timeout:g} s")

    async def _connection(self, origin: Origin,
                          window: int | None) -> tuple[_Connection, bool]:
        """An idle connection to `origin` opened with `window` (the most recently used), or
        a new one. Idle ones with another window stay for GETs that want theirs, unless
        none did for `keep_idle_s`; stale ones are closed."""
        idle = self._idle.get(origin, [])
        now = time.monotonic()
        found: _Connection | None = None
        closing: list[_Connection] = []
        for i in range(len(idle) - 1, -1, -1):  # no await in here: others use the list
            conn = idle[i]
            if conn.window != window:
                if now - conn.idle_since > self.keep_idle_s:
                    closing.append(idle.pop(i))
                continue
            idle.pop(i)
            if not conn.stale(now, self.keep_idle_s):
                found = conn
                break
            closing.append(conn)
        for conn in closing:
            await conn.aclose()
        if found is not None:
            return found, True
        return await self._open(origin, window), False

    async def _open(self, origin: Origin, window: int | None = None) -> _Connection:
        scheme, host, port = origin
        conn = None
        with trio.move_on_after(self.timeout) as scope:
            try:
                tcp = await _connect(await self.addresses.get(host, port), window)
            except OSError as e:
                self.addresses.forget(host, port)
                raise httpx.ConnectError(f"{e.strerror or e} ({host}:{port})") from e
            if window is None:
                rtt = handshake_rtt(tcp.socket)
                if rtt is not None and rtt < self.rtt.get(origin, float("inf")):
                    self.rtt[origin] = rtt
            else:
                self.stats.small_window_connections += 1
            if scheme == "http":
                conn = _Connection(tcp, tcp.socket, window)
            else:
                if self._tls is None:
                    self._tls = httpx.create_ssl_context()
                tls = _TlsStream(tcp, self._tls, host)
                try:
                    await tls.do_handshake()
                except (trio.BrokenResourceError, ssl.SSLError) as e:
                    await trio.aclose_forcefully(tcp)
                    raise httpx.ConnectError(str(e.__cause__ or e)) from e
                except BaseException:
                    await trio.aclose_forcefully(tcp)
                    raise
                conn = _Connection(tls, tcp.socket, window)
        if conn is None:
            assert scope.cancelled_caught
            self.addresses.forget(host, port)  # (as for a refusal: asked again next time)
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took over "
                                       f"{self.timeout:g} s")
        self.opened += 1
        return conn

    def release(self, origin: Origin, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(origin, []).append(conn)
        self._slots.release()

    async def discard(self, conn: _Connection) -> None:
        self._slots.release()  # first: closing raises Cancelled in a cancelled scope
        await conn.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await conn.aclose()


DEFAULT_PORTS = {"http": 80, "https": 443}


async def _connect(infos: list[AddressInfo], window: int | None) -> trio.SocketStream:
    """A TCP connection to the first of a host's addresses that answers; with `window`,
    its receive buffer is that many bytes from before its handshake (so the window it
    advertises, and its scale, start there: window.py). OSError if none answers.

    One socket and one connect per address, in turn: trio's `open_tcp_stream` races the
    addresses (happy eyeballs) in a nursery of its own, which cost the epoch's first fill
    GETs ~15 ms more to connect on a busy loop (docs/benchmarks-notes.md, "Connections
    opened lean"). An address that has not answered within CONNECT_TRY_S is left for the
    next one (the last one has the rest of the caller's timeout), as a race would."""
    error: OSError = OSError(errno.EHOSTUNREACH, "no address")
    for i, (family, kind, proto, _, address) in enumerate(infos):
        sock = trio.socket.socket(family, kind, proto)
        try:
            if window is not None:
                sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, window)
            with trio.move_on_after(CONNECT_TRY_S if i + 1 < len(infos) else math.inf):
                await sock.connect(address)
                return trio.SocketStream(sock)
            error = OSError(errno.ETIMEDOUT, f"{address[0]} did not answer in "
                                             f"{CONNECT_TRY_S:g} s")
            sock.close()
        except OSError as e:
            sock.close()
            error = e
        except BaseException:
            sock.close()
            raise
    raise error


def _origin(url: httpx.URL) -> Origin:
    return url.scheme, url.host, url.port or DEFAULT_PORTS[url.scheme]


def _request_head(request: httpx.Request) -> bytes:
    """The request line and headers, as httpx built them (Host, signatures, Range, ...)."""
    parts = [b"GET ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _body_length(status: int, version: bytes, headers: Headers) -> tuple[int | None, bool]:
    """(the body's length, whether the connection can carry another request); None where the
    length is not given by Content-Length (chunked, or up to the connection's close)."""
    length: int | None = None
    reusable = version == b"HTTP/1.1"
    for name, value in headers:
        lower = name.lower()
        if lower == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                return None, False
            length = int(value)
        elif lower == b"transfer-encoding":
            return None, False
        elif lower == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                reusable = False
            elif b"keep-alive" in tokens and version == b"HTTP/1.0":
                reusable = True
    if status == 204 or status == 304:
        return 0, reusable
    return length, reusable
