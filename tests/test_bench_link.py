"""bench/server.py's BandwidthCap on the real loopback: what it counts as crossing the link,
and that the qdisc it adds is gone afterwards."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading

import pytest

from bench.server import BandwidthCap, parse_tc_sent

N = 4 << 20


def _send_over_loopback(n: int) -> int:
    """Send n bytes from one local TCP socket to another; the bytes received."""
    server = socket.create_server(("127.0.0.1", 0))
    got = 0

    def receive() -> None:
        nonlocal got
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 16):
                got += len(chunk)

    receiver = threading.Thread(target=receive)
    receiver.start()
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(b"x" * n)
    receiver.join(timeout=30)
    server.close()
    return got


def _qdisc() -> str:
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                          text=True).stdout


@pytest.mark.skipif(shutil.which("tc") is None, reason="tc not installed (iproute2)")
def test_sent_bytes_count_what_crossed_the_cap() -> None:
    with BandwidthCap("10gbit") as cap:  # fast: other loopback users are not held up
        if not cap.active:
            pytest.skip(f"no cap on lo here: {cap.error}")
        assert "tbf" in _qdisc()
        before = cap.sent_bytes()
        assert _send_over_loopback(N) == N
        after = cap.sent_bytes()
    assert before is not None and after is not None
    assert N <= after - before < 2 * N  # the payload, plus headers and acks
    assert "tbf" not in _qdisc()  # removed on leaving the block
    assert cap.sent_bytes() is None  # uncapped now: nothing to count


def test_parse_tc_sent_reads_the_root_counter() -> None:
    text = ("qdisc tbf 8001: root refcnt 2 rate 800Mbit burst 1Mb lat 100ms\n"
            " Sent 355280044 bytes 25810 pkt (dropped 0, overlimits 8410 requeues 0)\n"
            " backlog 0b 0p requeues 0\n")
    assert parse_tc_sent(text) == 355280044
    assert parse_tc_sent("qdisc noqueue 0: root refcnt 2\n") is None
