"""The CPU price of where a whole-shard download's bytes land, before building anything.

`python -m bench bodycost`: a local nginx serves `--shards` files of random bytes; each is
received whole over one plain HTTP/1.1 connection, three ways, in turns:

- `splice`: socket -> pipe -> the part file's page cache (splice(2)), as sources/h1.py's
  `_Body.splice_into` does for every download today;
- `recv`: `recv_into` one reused, page-aligned buffer (the bytes stay in memory);
- `recv+direct`: that, then the buffer written into the part file with O_DIRECT (in 1 MiB
  writes; the file's pages are never made), as a download kept in memory would write it.

Before each way's pass the page cache is dropped and the served files read back in (nginx
then sends from memory), and the part files of a pass are kept until it ends (each pass makes
its pages new, as a cold pass's cache does). Reported: this process's CPU (user + system) per
`--file-kb` of body, i.e. per cold file of that size. Only this process's CPU counts (nginx's
is not the daemon's); the TCP receive work on loopback is in it. Run as root (drop_caches).
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.node import drop_caches
from bench.procs import own_cpu_s
from shardfs.devtools.nginx import Nginx

PIECE = 1 << 20  # most bytes one receive, splice or direct write moves
WAYS = ("splice", "recv", "recv+direct")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--mb", type=int, default=32, help="MiB per shard")
    p.add_argument("--rounds", type=int, default=4, help="turns through the three ways")
    p.add_argument("--file-kb", type=float, default=25.0,
                   help="report µs of CPU per this many KiB (a cold file's size)")
    p.add_argument("--workdir", default=None, help="where shards and part files go")


def _get(port: int, name: str) -> socket.socket:
    """A connection whose next bytes are the body of GET /name (its head read)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"GET /{name} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        if not byte:
            raise RuntimeError(f"nginx closed the connection before the head of /{name} ended")
        head += byte
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"GET /{name}: {head.splitlines()[0]!r}")
    return sock


def _splice(sock: socket.socket, part: Path, _buffer: memoryview) -> int:
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pipe_out, pipe_in = os.pipe()
    try:
        fcntl.fcntl(pipe_in, fcntl.F_SETPIPE_SZ, PIECE)
        at = 0
        while n := os.splice(sock.fileno(), pipe_in, PIECE, flags=os.SPLICE_F_MOVE):
            while n:
                moved = os.splice(pipe_out, fd, n, offset_dst=at)
                n -= moved
                at += moved
        return at
    finally:
        os.close(pipe_out)
        os.close(pipe_in)
        os.close(fd)


def _receive(sock: socket.socket, buffer: memoryview) -> int:
    at = 0
    while n := sock.recv_into(buffer[at:at + PIECE]):
        at += n
    return at


def _recv(sock: socket.socket, _part: Path, buffer: memoryview) -> int:
    return _receive(sock, buffer)


def _recv_direct(sock: socket.socket, part: Path, buffer: memoryview) -> int:
    size = _receive(sock, buffer)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        aligned = size - size % 4096  # (the shards' sizes are whole MiB: nothing is left)
        for at in range(0, aligned, PIECE):
            os.pwrite(fd, buffer[at:min(at + PIECE, aligned)], at)
    finally:
        os.close(fd)
    return size


def _drop_and_warm(files: list[Path]) -> None:
    drop_caches()
    for path in files:  # nginx sends from memory: only the receiving side is measured
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass


def bodycost_command(args: argparse.Namespace) -> int:
    ways: dict[str, Callable[[socket.socket, Path, memoryview], int]] = {
        "splice": _splice, "recv": _recv, "recv+direct": _recv_direct}
    size = args.mb << 20
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="shardfs-bodycost-") as tmp:
        work = Path(tmp)
        root = work / "www"
        root.mkdir()
        files = [root / f"shard-{i:03d}" for i in range(args.shards)]
        for path in files:
            path.write_bytes(os.urandom(size))
        buffer = mmap.mmap(-1, size)
        buffer.write(b"\0" * size)  # its pages made once, reused by every receive
        view = memoryview(buffer)
        server = Nginx(root, work / "nginx")
        server.start()
        per_file: dict[str, list[float]] = {way: [] for way in WAYS}
        try:
            for rnd in range(args.rounds):
                for k in range(len(WAYS)):
                    way = WAYS[(k + rnd) % len(WAYS)]
                    _drop_and_warm(files)
                    time.sleep(1)
                    parts = [work / f"part-{i:03d}" for i in range(len(files))]
                    received = 0
                    before = own_cpu_s()
                    for path, part in zip(files, parts, strict=True):
                        with _get(server.port, path.name) as sock:
                            received += ways[way](sock, part, view)
                    cpu = own_cpu_s() - before
                    for part in parts:
                        part.unlink(missing_ok=True)  # (recv writes none)
                    if received != size * len(files):
                        raise RuntimeError(f"{way}: {received} bytes of {size * len(files)}")
                    per_file[way].append(cpu / (received / (args.file_kb * 1024)) * 1e6)
        finally:
            server.stop()
            view.release()
            buffer.close()
    for way in WAYS:
        values = per_file[way]
        print(f"{way}: {statistics.median(values):.1f} us CPU per {args.file_kb:g} KiB "
              f"(median of {len(values)}; " + " ".join(f"{v:.1f}" for v in values) + ")")
    return 0
