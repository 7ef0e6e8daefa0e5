"""bench/server.py's link caps on the real loopback: what they count as crossing the link,
that PortCap shapes only one port's replies, and that the qdiscs they add are gone
afterwards."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading

import pytest

from bench.server import BandwidthCap, PortCap, parse_tc_sent

N = 4 << 20


def _send_over_loopback(n: int, server: socket.socket | None = None, *,
                        reply: bool = False) -> int:
    """Send n bytes between two local TCP sockets, from the client to the listening socket
    (or, with `reply`, from the listening socket's side to the client); the bytes received."""
    server = server or socket.create_server(("127.0.0.1", 0))
    got = 0

    def serve() -> None:
        nonlocal got
        conn, _ = server.accept()
        with conn:
            if reply:
                conn.sendall(b"x" * n)
                return
            while chunk := conn.recv(1 << 16):
                got += len(chunk)

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(server.getsockname()) as client:
        if reply:
            while chunk := client.recv(1 << 16):
                got += len(chunk)
        else:
            client.sendall(b"x" * n)
    thread.join(timeout=30)
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


@pytest.mark.skipif(shutil.which("tc") is None, reason="tc not installed (iproute2)")
def test_a_port_cap_counts_only_that_ports_replies() -> None:
    """`bench run` and `bench s3` shape only the server's replies: bytes sent *to* the port
    (requests) and other loopback traffic pass by the tbf."""
    server = socket.create_server(("127.0.0.1", 0))
    with PortCap(server.getsockname()[1], "10gbit") as cap:
        if not cap.active:
            server.close()
            pytest.skip(f"no cap on lo here: {cap.error}")
        assert "htb" in _qdisc() and "tbf" in _qdisc()
        before = cap.sent_bytes()
        assert _send_over_loopback(N, server, reply=True) == N  # replies from the port
        replied = cap.sent_bytes()
        other = socket.create_server(("127.0.0.1", 0))
        assert _send_over_loopback(N, other) == N  # not from the port: unshaped, uncounted
        after = cap.sent_bytes()
    assert before is not None and replied is not None and after is not None
    assert N <= replied - before < 2 * N
    assert after - replied < N // 4  # at most the first connection's closing packets
    assert "tbf" not in _qdisc() and "htb" not in _qdisc()


def test_parse_tc_sent_reads_the_root_counter() -> None:
    text = ("qdisc tbf 8001: root refcnt 2 rate 800Mbit burst 1Mb lat 100ms\n"
            " Sent 355280044 bytes 25810 pkt (dropped 0, overlimits 8410 requeues 0)\n"
            " backlog 0b 0p requeues 0\n")
    assert parse_tc_sent(text) == 355280044
    assert parse_tc_sent("qdisc noqueue 0: root refcnt 2\n") is None


@pytest.mark.skipif(shutil.which("tc") is None, reason="tc not installed (iproute2)")
def test_bench_runs_queue_ms_is_the_links_queue() -> None:
    """`bench run --rate R --queue-ms Q` puts a tbf of rate R and latency Q on the store's
    replies (the option reaches the qdisc, not only the record)."""
    import argparse

    from bench.run import add_run_arguments, link_cap

    p = argparse.ArgumentParser()
    add_run_arguments(p)
    a = p.parse_args(["--rate", "10gbit", "--queue-ms", "10"])
    server = socket.create_server(("127.0.0.1", 0))
    try:
        with link_cap(a, server.getsockname()[1]) as cap:
            if not cap.active:
                pytest.skip(f"no cap on lo here: {cap.error}")
            assert "lat 10ms" in _qdisc() or "lat 10.0ms" in _qdisc(), _qdisc()
            assert "latency 10ms" in cap.describe()
        assert "tbf" not in _qdisc()
        a = p.parse_args(["--no-tc"])
        with link_cap(a, server.getsockname()[1]) as cap:
            assert not cap.active and "tbf" not in _qdisc()
    finally:
        server.close()
