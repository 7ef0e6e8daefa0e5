"""CPU per GB that the daemon's HTTP source spends receiving whole shards.

`python -m bench httpcpu`: one local nginx (no bandwidth cap) serves a file of random bytes;
`HttpSource.stream` reads it whole over several connections at once, for each httpcore
receive size asked for, in turns. Reports process CPU seconds per GB received, GB/s, and the
mean piece size the stream yielded. Nothing is written to disk but the served file.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import httpcore
import trio

from shardfs.devtools.nginx import Nginx
from shardfs.sources.base import ShardInfo, SourceSettings
from shardfs.sources.http import HttpSource


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="64,256,1024",
                   help="httpcore receive sizes to compare, KiB, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="turns through all sizes")
    p.add_argument("--streams", type=int, default=8, help="connections at once")
    p.add_argument("--mb", type=int, default=256, help="size of the served file, MB")
    p.add_argument("--stdlib", action="store_true",
                   help="also: the standard library's http.client, readinto a 1 MiB buffer, one "
                        "thread per connection, with and without pwrite to a file (a receive "
                        "path shardfs does not have; docs/benchmarks-notes.md)")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _receive(receive: int, url: str, size: int,
                   streams: int) -> tuple[float, float, float]:
    # chunk_size above any receive: the stream yields what httpcore received, unsplit.
    source = HttpSource(SourceSettings(chunk_size=64 << 20))
    # After the source raised it as the daemon's does: the size under test.
    httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = receive
    info = ShardInfo(url=url, size=size)
    pieces: list[int] = []

    async def one() -> None:
        async for piece in source.stream(info, 0, size):
            pieces.append(len(piece))

    cpu0, t0 = _cpu_s(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            nursery.start_soon(one)
    cpu1, t1 = _cpu_s(), time.perf_counter()
    await source.aclose()
    gb = size * streams / 1e9
    return (cpu1 - cpu0) / gb, gb / (t1 - t0), sum(pieces) / len(pieces)


def _receive_stdlib(port: int, path: str, size: int, streams: int,
                    sink: int | None) -> tuple[float, float]:
    """The same transfers by http.client in threads; each buffer pwritten to `sink` if set."""
    import http.client
    import threading

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            view = memoryview(bytearray(1 << 20))
            got = 0
            while n := resp.readinto(view):
                if sink is not None:
                    os.pwrite(sink, view[:n], got % (64 << 20))  # a 64 MiB file, reused
                got += n
            assert got == size, (got, size)
        finally:
            conn.close()

    threads = [threading.Thread(target=one) for _ in range(streams)]
    cpu0, t0 = _cpu_s(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu1, t1 = _cpu_s(), time.perf_counter()
    gb = size * streams / 1e9
    return (cpu1 - cpu0) / gb, gb / (t1 - t0)


def httpcpu_command(args: argparse.Namespace) -> int:
    sizes = [int(k) * 1024 for k in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="shardfs-httpcpu-") as tmp:
        root = Path(tmp)
        (root / "www").mkdir()
        served = root / "www" / "shard.bin"
        with served.open("wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        with Nginx(root / "www", root / "nginx") as server:
            url = f"{server.url}/shard.bin"
            for _ in range(args.rounds):
                for receive in sizes:
                    cpu_gb, gb_s, mean = trio.run(_receive, receive, url, args.mb << 20,
                                                  args.streams)
                    print(f"receive {receive >> 10:5d} KiB: {cpu_gb:.2f} CPU s/GB, "
                          f"{gb_s:.2f} GB/s, mean piece {mean / 1024:.0f} KiB", flush=True)
                if args.stdlib:
                    sink = os.open(root / "sink", os.O_RDWR | os.O_CREAT, 0o600)
                    try:
                        for label, fd in (("", None), (", pwrite", sink)):
                            cpu_gb, gb_s = _receive_stdlib(server.port, "/shard.bin",
                                                           args.mb << 20, args.streams, fd)
                            print(f"http.client readinto, threads{label}: {cpu_gb:.2f} CPU "
                                  f"s/GB, {gb_s:.2f} GB/s", flush=True)
                    finally:
                        os.close(sink)
    return 0
