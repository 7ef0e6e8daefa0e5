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
    return 0
