"""The addresses a connection to an origin is opened to, resolved once for many connections.

Why: an epoch's first `Lookahead` GETs open tens of connections at once. trio's
`getaddrinfo` lets the loop run other tasks even when it needs no lookup (an IP literal:
it answers at once, then checkpoints), and for a name it asks the system's resolver in a
thread, one per connection. A GET launched before the loop plans the next ones then sent its
request only after that planning (docs/benchmarks-notes.md, "An epoch's first GETs without a
lookup each"). Here an IP literal is its own address, with no pause, and a name's
addresses are kept `TTL_S` seconds (as aiohttp's resolver cache does by default), so that
the connections of one burst share one lookup and a changed DNS answer is taken within
seconds.
"""

from __future__ import annotations

import socket
import time

import trio

TTL_S = 10.0  # how long a name's resolved addresses are used for new connections

# (family, type, proto, canonname, sockaddr), as getaddrinfo gives them
AddressInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str,
                    tuple[str, int] | tuple[str, int, int, int]]


def literal(host: str, port: int) -> list[AddressInfo] | None:
    """The address of an IPv4 or IPv6 literal (None: a name)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except (OSError, ValueError):
            continue
        address: tuple[str, int] | tuple[str, int, int, int] = \
            (host, port) if family == socket.AF_INET else (host, port, 0, 0)
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", address)]
    return None


class Addresses:
    """Resolved TCP addresses by (host, port): literals at once, names kept TTL_S seconds;
    connections opened while a name is being looked up wait for that one lookup."""

    def __init__(self, ttl_s: float = TTL_S) -> None:
        self.ttl_s = ttl_s
        self._names: dict[tuple[str, int], tuple[float, list[AddressInfo]]] = {}
        self._asking: dict[tuple[str, int], trio.Event] = {}  # lookups under way
        self.lookups = 0  # names asked of the resolver (for tests and benchmarks)

    async def get(self, host: str, port: int) -> list[AddressInfo]:
        """The host's addresses, in the resolver's order; OSError (socket.gaierror) where a
        name does not resolve (not kept: the next connection asks again)."""
        found = literal(host, port)
        if found is not None:
            return found
        key = (host, port)
        while True:
            kept = self._names.get(key)
            if kept is not None and time.monotonic() - kept[0] < self.ttl_s:
                return kept[1]
            asking = self._asking.get(key)
            if asking is None:
                break
            await asking.wait()  # then its answer; where it failed, a lookup of our own
        done = self._asking[key] = trio.Event()
        try:
            self.lookups += 1
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            self._names[key] = (time.monotonic(), infos)  # type: ignore[assignment]
            return infos  # type: ignore[return-value]
        finally:
            del self._asking[key]
            done.set()

    def forget(self, host: str, port: int) -> None:
        """Drop a name's kept addresses (none of them answered: the next connection asks
        the resolver again)."""
        self._names.pop((host, port), None)
