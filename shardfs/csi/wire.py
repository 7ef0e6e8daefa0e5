"""The plugin <-> mounter channel: JSON messages with FUSE descriptors attached (SCM_RIGHTS).

A Unix SOCK_SEQPACKET socket, so that each message arrives whole with its descriptors. JSON,
never pickle: the plugin runs as root and the mounter does not, and neither may run code the
other sends. The mounter accepts only root or its own uid as a peer (SO_PEERCRED).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from typing import Any

MAX_MESSAGE = 1 << 20
MAX_FDS = 16


class WireError(OSError):
    """The peer closed the connection, or sent something that is not a message of ours."""


def socket_path(address: str) -> str:
    """`unix:///run/x.sock` (CSI's endpoint form) or a plain path -> the path."""
    if address.startswith("unix://"):
        address = address[len("unix://"):]
    if not address.startswith("/"):
        raise ValueError(f"expected unix:///ABSOLUTE/PATH, got {address!r}")
    return address


def listen(path: str) -> socket.socket:
    """A listening socket at `path`, replacing a leftover socket file of a dead process."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.bind(path)
    sock.listen(16)
    return sock


def connect(path: str, timeout: float | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()
         ) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes is too large")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it (the caller owns them)."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    if not data:
        _close_all(received)
        raise WireError("connection closed")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        _close_all(received)
        raise WireError("message or descriptors truncated")
    try:
        message = json.loads(data)
    except ValueError:
        _close_all(received)
        raise WireError("not a JSON message") from None
    if not isinstance(message, dict):
        _close_all(received)
        raise WireError("not a JSON object")
    return message, received


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
