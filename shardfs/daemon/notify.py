"""sd_notify: tell systemd (Type=notify) about readiness and status. No-op without systemd."""

from __future__ import annotations

import os
import socket


def sd_notify(*fields: str) -> bool:
    """Send `READY=1`, `STATUS=...`, ... to $NOTIFY_SOCKET; False when there is none."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall("\n".join(fields).encode())
    return True
