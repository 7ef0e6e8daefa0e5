"""Small receive windows for downloads that crowd a near link's queue.

Why: in a cold epoch's first second the reader runs two whole-shard downloads beside the
first reads' member GETs (read/allowance.py, the cold start). A sender keeps about its
congestion window of each download's bytes queued at the link's bottleneck (BBR, cubic:
hundreds of KB to MBs), and a member's reply waits behind them: on the bench's link (100
MB/s, a FIFO queue) 13 ms per member GET on average, p90 31 ms, with 0.5-0.7 MB queued
(docs/benchmarks-notes.md, "The cold start's downloads with small receive windows"). The
receiver bounds what a sender can have in flight by the window it advertises: a download
whose connection receives into a small buffer (SO_RCVBUF, which also turns the kernel's
autotuning off for it) keeps its share of that queue near its window. (TCP_WINDOW_CLAMP does
not do this: receive autotuning raises the clamp again as it grows the buffer.)

When: only where a queue is seen. A window assumed small from the start throttled downloads
on a link faster than the daemon (loopback: 80-98 instead of 64 µs of CPU per cold file, the
daemon draining 32 KiB windows), so a download starts autotuned and `QueueWatch` looks at its
connection every 128 KiB: once the kernel's receive-side round trip (TCP_INFO's rcv_rtt: from
an ACK sent to the data it let the sender send) stands 2 ms above the origin's handshake round
trip in three looks in a row, bytes wait in a queue on the way, and the connection is capped
there and then. On the bench's link that is 10-20 ms into the first download. Where the
daemon holds the download back instead (its bytes pile up in the socket: loopback uncapped),
rcv_rtt can stand that high too, after the daemon's pauses (0.15 ms median, 2 ms for tens of
ms at a time): a look that finds more than 256 KiB unread in the socket does not count.

How much: half a millisecond of the download's rate so far, plus two base round trips (a
far link's bytes in flight), at least 32 KiB (100 MB/s: ~50 KB); where that is more than the
kernel lets a process ask for (net.core.rmem_max) nothing is capped. A connection capped while
it receives keeps room for one and a quarter of its segments (`live_cap`).

Who asks: a task sets `SMALL_WINDOW` for the GETs it sends (download.py does for a download
started while the cold start runs, of a shard of the size it holds back, unless
`--small-windows off`). The pool (h1.py) watches
such a GET's body; once one was capped, the origin's window is known, and the later ones go
over connections opened with it (the buffer set before the handshake), which carry no other
GET (a window once advertised cannot be taken back, so a connection is never made larger
again). An idle one is closed by the next GET to its origin that finds it unused for
`keep_idle_s`, or when the source closes.
"""

from __future__ import annotations

import array
import fcntl
import socket
import struct
import termios
import time
from contextvars import ContextVar
from typing import Protocol

# Set (True) by a task whose GETs should be capped where a queue is seen.
SMALL_WINDOW: ContextVar[bool] = ContextVar("shardfs_small_window", default=False)

MIN_WINDOW = 32 << 10  # 22 segments of 1,448 bytes; on loopback (64 KiB segments) still full
DRAIN_S = 0.5e-3  # seconds of the download's rate a capped window holds
QUEUE_S = 2e-3  # a standing queue: the receive-side round trip this far above the handshake's
QUEUE_LOOKS = 3  # in this many looks in a row
LOOK_BYTES = 128 << 10  # a look every this many bytes received
# More bytes than this waiting in the socket: the daemon, not the link, holds the download back
BACKLOG_BYTES = 256 << 10
LIVE_MSS = 1.25  # a live connection's cap: at least this many of its segments
# struct tcp_info: after 8 bytes of u8 fields, u32s: tcpi_rcv_mss the 4th (bytes), tcpi_rtt
# the 16th, tcpi_rcv_rtt the 22nd (µs both).
_TCP_INFO_RCV_MSS = 20
_TCP_INFO_RTT = 68
_TCP_INFO_RCV_RTT = 92
_RMEM_MAX = "/proc/sys/net/core/rmem_max"


class _Socket(Protocol):  # a socket.socket, or trio's
    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...

    def fileno(self) -> int: ...


def _tcp_info_us(sock: _Socket, offset: int) -> int | None:
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    if len(info) < offset + 4:
        return None
    (value,) = struct.unpack_from("I", info, offset)
    return value


def handshake_rtt(sock: _Socket) -> float | None:
    """The connection's smoothed round trip (seconds) from the kernel's TCP_INFO; right
    after connecting, the handshake's. None where the kernel does not say."""
    rtt_us = _tcp_info_us(sock, _TCP_INFO_RTT)
    return rtt_us / 1e6 if rtt_us else None


def receive_rtt(sock: _Socket) -> float | None:
    """The kernel's estimate of the round trip as the receiver sees it (seconds): from an
    ACK it sent to the data that ACK let the sender send, queues on the way included. None
    where the kernel does not say or has no estimate yet."""
    rtt_us = _tcp_info_us(sock, _TCP_INFO_RCV_RTT)
    return rtt_us / 1e6 if rtt_us else None


def live_cap(sock: _Socket, window: int) -> int:
    """The receive buffer to cap a connection that has received at `window`: at least 1.25
    of the segments it receives. A sender keeps sending full segments once it has seen a
    large window (Linux bounds its segment to half the largest window seen), and a buffer
    smaller than one stalls it: loopback's 64 KiB segments with a 32 KiB cap moved a few
    KB/s, with 64 KiB 1.4 GB/s. A connection opened small negotiates segments that fit."""
    mss = _tcp_info_us(sock, _TCP_INFO_RCV_MSS) or 0
    return max(window, int(LIVE_MSS * mss))


def unread(sock: _Socket) -> int:
    """Bytes that have arrived in the socket and are not read yet (0 where unknown)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


def rmem_max() -> int:
    """The most a process may ask SO_RCVBUF for (net.core.rmem_max)."""
    try:
        with open(_RMEM_MAX) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 212_992  # Linux's default


def rate_window(rate: float, base_rtt: float, limit: int) -> int | None:
    """The receive buffer for a download arriving at `rate` bytes/s over a link with this
    base round trip, or None where none should be capped (more than `limit`, the kernel's
    net.core.rmem_max, allows)."""
    window = max(MIN_WINDOW, int(rate * (2 * base_rtt + DRAIN_S)))
    return window if window <= limit else None


class QueueWatch:
    """Looks at one body's connection as its bytes arrive; says the window to cap it at once
    a standing queue is seen (the module's docstring)."""

    __slots__ = ("_base_rtt", "_limit", "_looks", "_next_look", "_received", "_sock",
                 "_started")

    def __init__(self, sock: _Socket, base_rtt: float, limit: int) -> None:
        self._sock = sock
        self._base_rtt = base_rtt
        self._limit = limit
        self._started = time.monotonic()  # the answer's head has arrived
        self._received = 0
        self._next_look = LOOK_BYTES
        self._looks = 0  # looks in a row that saw a queue

    def received(self, count: int) -> int | None:
        """Count `count` more bytes of the body; the window to cap the connection at where
        a queue stands (then the watch is done), else None."""
        self._received += count
        if self._received < self._next_look:
            return None
        self._next_look = self._received + LOOK_BYTES
        rtt = receive_rtt(self._sock)
        if (rtt is None or rtt < self._base_rtt + QUEUE_S
                or unread(self._sock) > BACKLOG_BYTES):
            self._looks = 0
            return None
        self._looks += 1
        if self._looks < QUEUE_LOOKS:
            return None
        elapsed = max(time.monotonic() - self._started, 1e-6)
        return rate_window(self._received / elapsed, self._base_rtt, self._limit)
