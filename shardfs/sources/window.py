"""Small receive windows for downloads that must not crowd a near link's queue.

Why: in a cold epoch's first second the reader runs two whole-shard downloads beside the
first reads' member GETs (read/allowance.py, the cold start). A sender keeps about its
congestion window of each download's bytes queued at the link's bottleneck (BBR, cubic:
hundreds of KB to MBs), and a member's reply waits behind them: on the bench's link (100
MB/s, a FIFO queue) 13 ms per member GET on average, p90 31 ms, with 0.5-0.7 MB queued
(docs/benchmarks-notes.md, "The cold start's downloads with small receive windows"). The
receiver bounds what a sender can have in flight by the window it advertises; a download's
connection opened with a small receive buffer (SO_RCVBUF, set before connecting, which also
turns the kernel's autotuning off for it) keeps its share of that queue near its window,
and on a near link it still gets the whole link: with a base round trip of tens of µs any
window keeps the bottleneck busy. (TCP_WINDOW_CLAMP does not do this: receive autotuning
raises the clamp again as it grows the buffer.)

How much: twice the bytes a 10 Gb/s link carries in the origin's shortest handshake round
trip (the pool measures it on every connection it opens), at least 32 KiB; where that is
more than the kernel lets a process ask for (net.core.rmem_max, 212,992 bytes by default)
the link is not near and nothing is capped: a small window there would throttle the
download (100 ms away, 208 KiB is 2 MB/s).

Who asks: a task sets `SMALL_WINDOW` for the GETs it sends (download.py does with
`--small-windows on`, off by default, for a download started while the cold start runs);
the pool (h1.py) sends those over connections opened with the window, which carry no other
GET (a window once advertised cannot be taken back, so a connection is never made smaller,
nor larger, afterwards). An idle one is closed by the next GET to its origin that finds it
unused for `keep_idle_s`, or when the source closes.
"""

from __future__ import annotations

import socket
import struct
from contextvars import ContextVar
from typing import Protocol

# Set (True) by a task whose GETs should go over small-window connections.
SMALL_WINDOW: ContextVar[bool] = ContextVar("shardfs_small_window", default=False)

MIN_WINDOW = 32 << 10  # 22 segments of 1,448 bytes; on loopback (64 KiB segments) still full
NEAR_RATE = 1.25e9  # bytes/s: the link speed a window is sized for (10 Gb/s)
_TCP_INFO_RTT = 68  # struct tcp_info: tcpi_rtt (µs), after 8 bytes of u8 fields and 15 u32s
_RMEM_MAX = "/proc/sys/net/core/rmem_max"


class _Socket(Protocol):  # a socket.socket, or trio's
    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


def handshake_rtt(sock: _Socket) -> float | None:
    """The connection's smoothed round trip (seconds) from the kernel's TCP_INFO; right
    after connecting, the handshake's. None where the kernel does not say."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    if len(info) < _TCP_INFO_RTT + 4:
        return None
    (rtt_us,) = struct.unpack_from("I", info, _TCP_INFO_RTT)
    return rtt_us / 1e6 if rtt_us else None


def rmem_max() -> int:
    """The most a process may ask SO_RCVBUF for (net.core.rmem_max)."""
    try:
        with open(_RMEM_MAX) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 212_992  # Linux's default


def small_window(rtt: float | None, limit: int) -> int | None:
    """The receive buffer for a small-window connection over a link with this base round
    trip, or None where none should be capped (the round trip unknown, or the link too far
    for a window the kernel allows: `limit`, net.core.rmem_max)."""
    if rtt is None:
        return None
    window = max(MIN_WINDOW, int(2 * rtt * NEAR_RATE))
    return window if window <= limit else None
