"""A small fault-injecting HTTP/1.1 proxy for loopback tests, in front of nginx.

    with FaultProxy(nginx.port) as proxy:
        proxy.reset_after(100_000)          # every response: RST after 100 kB of body
        proxy.fail(503, times=3, retry_after="1")
        proxy.stall(2.0, times=1)           # answer the next request 2 s late
        proxy.release_stalls()              # end the stalls in progress now
        proxy.refuse_connections(); proxy.accept_connections()
        proxy.clear()
        proxy.requests                      # what clients sent (method, target, headers)
        proxy.body_bytes                    # response body bytes sent to clients

One thread accepts, one thread serves each client connection (bounded); each request goes
to the upstream on a fresh connection, so faults never leave the upstream in an odd state.
Requests are forwarded unchanged (Range, If-Match, ...) except for connection management.
"""

from __future__ import annotations

import contextlib
import fcntl
import select
import socket
import struct
import termios
import threading
import time
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType

IO_TIMEOUT_S = 30.0  # no socket of ours blocks longer than this
MAX_HEAD = 64 * 1024
CHUNK = 64 * 1024
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection"})


@dataclass(frozen=True, slots=True)
class Fault:
    """What to do to the next requests. Body byte counts refer to the response body."""

    status: int | None = None  # answer with this status (e.g. 503) instead of forwarding
    retry_after: str | None = None  # Retry-After header for `status`
    stall_s: float = 0.0  # wait this long before answering...
    stall_after: int | None = None  # ...or, if set, after this many body bytes
    reset_after: int | None = None  # send this many body bytes, then reset the connection (RST)
    truncate_after: int | None = None  # send this many body bytes, then close cleanly (FIN)
    times: int | None = None  # number of requests affected; None: all until clear()


@dataclass(frozen=True, slots=True)
class ProxiedRequest:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names
    fault: Fault | None  # the fault applied to this request, if any


class FaultProxy:
    """Listens on 127.0.0.1 and forwards to 127.0.0.1:upstream_port, injecting faults."""

    def __init__(
        self,
        upstream_port: int,
        *,
        upstream_host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = 64,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = port
        self.max_connections = max_connections
        self.connections_accepted = 0
        self.faults_injected = 0
        self.body_bytes = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._release = threading.Event()  # set: stalls in progress end now
        self._fault: Fault | None = None
        self._remaining: int | None = None
        self._log: deque[ProxiedRequest] = deque(maxlen=10_000)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._threads: set[threading.Thread] = set()
        self._sockets: set[socket.socket] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self.accept_connections()
        return self

    def close(self) -> None:
        """Stop listening, drop every connection and join every thread."""
        self._closing.set()
        self._stop_listening()
        self._drop_connections()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(5.0)
        leaked = [t.name for t in threads if t.is_alive()]
        if leaked:
            raise RuntimeError(f"FaultProxy threads did not stop: {leaked}")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- faults ------------------------------------------------------------------------------

    def set_fault(self, fault: Fault | None) -> None:
        with self._lock:
            self._release.clear()
            self._fault = fault
            self._remaining = fault.times if fault is not None else None

    def clear(self) -> None:
        self.set_fault(None)

    def reset_after(self, nbytes: int, *, times: int | None = None) -> None:
        self.set_fault(Fault(reset_after=nbytes, times=times))

    def truncate_after(self, nbytes: int, *, times: int | None = None) -> None:
        self.set_fault(Fault(truncate_after=nbytes, times=times))

    def stall(
        self, seconds: float, *, after_bytes: int | None = None, times: int | None = None
    ) -> None:
        self.set_fault(Fault(stall_s=seconds, stall_after=after_bytes, times=times))

    def release_stalls(self) -> None:
        """End every stall in progress (the responses go on); later stalls are unaffected
        once a new fault is set."""
        self._release.set()

    def _pause(self, seconds: float, client: socket.socket) -> bool:
        """Sleep for a stall; True if the proxy is closing or the client hung up (give up
        the connection). A stalled request whose client gave up must not keep its slot of
        max_connections: after a long black-hole outage, the client's timed-out requests
        would otherwise fill every slot, and the proxy would refuse the requests of the
        recovered "server" until the stalls ran out."""
        deadline = time.monotonic() + seconds
        while not self._release.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._closing.wait(min(left, 0.05)) or _hung_up(client):
                return True
        return self._closing.is_set()

    def fail(
        self, status: int = 503, *, times: int | None = None, retry_after: str | None = None
    ) -> None:
        self.set_fault(Fault(status=status, retry_after=retry_after, times=times))

    def refuse_connections(self) -> None:
        """Stop listening (connects get ECONNREFUSED) and drop open connections."""
        self._stop_listening()
        self._drop_connections()

    def accept_connections(self) -> None:
        """Listen again, on the same port."""
        if self._listener is not None:
            return
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.settimeout(0.05)  # lets the acceptor notice a stop quickly
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(listener,), name="faultproxy-accept", daemon=True
        )
        self._acceptor.start()

    # -- counters ----------------------------------------------------------------------------

    @property
    def requests(self) -> list[ProxiedRequest]:
        with self._lock:
            return list(self._log)

    def reset_counters(self) -> None:
        with self._lock:
            self._log.clear()
            self.connections_accepted = 0
            self.faults_injected = 0
            self.body_bytes = 0

    # -- internals: connections --------------------------------------------------------------

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        acceptor, self._acceptor = self._acceptor, None
        if listener is not None:
            listener.close()
        if acceptor is not None:
            acceptor.join(5.0)

    def _drop_connections(self) -> None:
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it

    def _accept_loop(self, listener: socket.socket) -> None:
        while self._listener is listener and not self._closing.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            conn.settimeout(IO_TIMEOUT_S)
            with self._lock:
                self._threads = {t for t in self._threads if t.is_alive()}
                if len(self._threads) >= self.max_connections:
                    conn.close()
                    continue
                self.connections_accepted += 1
                t = threading.Thread(
                    target=self._serve, args=(conn,), name="faultproxy-conn", daemon=True
                )
                self._threads.add(t)
                self._sockets.add(conn)
            t.start()

    def _track(self, s: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._sockets.add(s)
            else:
                self._sockets.discard(s)

    def _take_fault(self) -> Fault | None:
        with self._lock:
            fault = self._fault
            if fault is None:
                return None
            if self._remaining is not None:
                self._remaining -= 1
                if self._remaining <= 0:
                    self._fault = None
            self.faults_injected += 1
            return fault

    # -- internals: one client connection ----------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        try:
            buf = b""
            while not self._closing.is_set():
                head, buf = _read_head(client, buf)
                if head is None:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = _parse_headers(lines[1:])
                body, buf = _read_exact(client, buf, int(headers.get("content-length", "0")))
                fault = self._take_fault()
                with self._lock:
                    self._log.append(ProxiedRequest(method, target, headers, fault))
                if not self._answer(client, method, lines, body, fault):
                    return
        except (OSError, ValueError):
            return  # client gone, reset by us, or spoke garbage
        finally:
            self._track(client, add=False)
            client.close()

    def _answer(
        self, client: socket.socket, method: str, lines: list[str], body: bytes, fault: Fault | None
    ) -> bool:
        """Answer one request; True if the client connection can carry another."""
        stall_first = fault is not None and fault.stall_s > 0 and fault.stall_after is None
        if fault is not None and stall_first and self._pause(fault.stall_s, client):
            return False
        if fault and fault.status:
            client.sendall(_canned(fault.status, fault.retry_after, with_body=method != "HEAD"))
            return True
        try:
            upstream = socket.create_connection(self.upstream, timeout=IO_TIMEOUT_S)
        except OSError:
            client.sendall(_canned(502, None, with_body=method != "HEAD"))
            return True
        self._track(upstream, add=True)
        try:
            kept = [ln for ln in lines if ln.split(":", 1)[0].strip().lower() not in HOP_BY_HOP]
            upstream.sendall(
                ("\r\n".join([*kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1") + body
            )
            resp_head, rest = _read_head(upstream, b"")
            if resp_head is None:
                client.sendall(_canned(502, None, with_body=method != "HEAD"))
                return False
            return self._relay(client, upstream, method, resp_head, rest, fault)
        finally:
            self._track(upstream, add=False)
            upstream.close()

    def _relay(
        self,
        client: socket.socket,
        upstream: socket.socket,
        method: str,
        resp_head: bytes,
        rest: bytes,
        fault: Fault | None,
    ) -> bool:
        lines = resp_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = _parse_headers(lines[1:])
        length: int | None
        if method == "HEAD" or status in (204, 304) or status < 200:
            length = 0
        elif "content-length" in headers and "transfer-encoding" not in headers:
            length = int(headers["content-length"])
        else:
            length = None  # body runs to EOF (or is chunked): the client connection ends too
        kept = [ln for ln in lines if ln.split(":", 1)[0].strip().lower() not in HOP_BY_HOP]
        connection = "keep-alive" if length is not None else "close"
        client.sendall(
            ("\r\n".join([*kept, f"Connection: {connection}"]) + "\r\n\r\n").encode("latin-1")
        )
        complete = self._pump(client, upstream, rest, length, fault)
        return complete and length is not None

    def _pump(
        self,
        client: socket.socket,
        upstream: socket.socket,
        pending: bytes,
        length: int | None,
        fault: Fault | None,
    ) -> bool:
        """Copy the body, applying stall/cut faults; True if all of it was sent."""
        cut = reset = None
        stall_at = None
        if fault is not None:
            cut = fault.reset_after if fault.reset_after is not None else fault.truncate_after
            reset = fault.reset_after is not None
            stall_at = fault.stall_after if fault.stall_s else None
        sent = 0
        while length is None or sent < length:
            if stall_at is not None and sent >= stall_at:
                stall_at = None
                if self._pause(fault.stall_s if fault else 0.0, client):
                    return False
            if cut is not None and sent >= cut:
                _cut(client, reset=bool(reset))
                return False
            if not pending:
                pending = upstream.recv(CHUNK)
                if not pending:
                    return length is None  # upstream EOF: complete only if EOF-delimited
            room = len(pending) if length is None else length - sent
            for mark in (stall_at, cut):
                if mark is not None:
                    room = min(room, mark - sent)
            piece, pending = pending[:room], pending[room:]
            client.sendall(piece)
            sent += len(piece)
            with self._lock:
                self.body_bytes += len(piece)
        return True


def _hung_up(sock: socket.socket) -> bool:
    """True if the peer closed (or reset) its end; data waiting to be read is not a hang-up."""
    try:
        # select first: on a socket with a timeout, recv itself would wait for data.
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (ValueError, OSError):
        return True  # closed (fileno -1) or reset


def _cut(sock: socket.socket, *, reset: bool) -> None:
    if reset:
        _drain(sock)  # an RST discards unsent data: let what we "sent" actually arrive
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    else:
        sock.shutdown(socket.SHUT_WR)


def _drain(sock: socket.socket, timeout: float = 1.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))
        except OSError:
            return
        if queued[0] == 0:
            return
        time.sleep(0.002)


def _read_head(sock: socket.socket, buf: bytes) -> tuple[bytes | None, bytes]:
    """(head without the blank line, bytes after it); head None on EOF before a full head."""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEAD:
            raise ValueError("HTTP head too large")
        data = sock.recv(CHUNK)
        if not data:
            return None, b""
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _read_exact(sock: socket.socket, buf: bytes, n: int) -> tuple[bytes, bytes]:
    while len(buf) < n:
        data = sock.recv(CHUNK)
        if not data:
            raise ValueError("request body cut short")
        buf += data
    return buf[:n], buf[n:]


def _parse_headers(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return headers


def _canned(status: int, retry_after: str | None, *, with_body: bool) -> bytes:
    reason = HTTPStatus(status).phrase
    body = f"{status} {reason} (injected by FaultProxy)\n".encode()
    lines = [
        f"HTTP/1.1 {status} {reason}",
        "Content-Type: text/plain",
        f"Content-Length: {len(body)}",
        "Connection: keep-alive",
    ]
    if retry_after is not None:
        lines.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body if with_body else b"")
