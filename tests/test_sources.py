"""Sources against a real nginx (and a fault-injecting proxy in front of it), and local files."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import http.server
import os
import random
import select
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import httpcore
import pytest
import trio

from shardfs.devtools.nginx import Nginx
from shardfs.sources import (
    FileSource,
    HttpSource,
    NotFound,
    ShardChanged,
    ShardInfo,
    Source,
    SourceError,
    Sources,
    SourceSettings,
    Unreachable,
    Written,
    h1,
    to_url,
)
from shardfs.sources.http import HTTP_RECEIVE_BYTES
from tests.faultproxy import FaultProxy

# The `nginx` fixture comes from tests/nginx_fixture.py via tests/conftest.py.

T = TypeVar("T")

CHUNK = 64 * 1024
# Short limits so fault tests finish quickly; the deadline still spans several retries.
FAST = SourceSettings(
    timeout=1.0, deadline=3.0, backoff_initial=0.02, backoff_max=0.2, chunk_size=CHUNK
)
SIZE = 1_000_003  # not a multiple of anything


# -- helpers -----------------------------------------------------------------------------------


def put(root: Path, name: str, size: int = SIZE, seed: int = 0) -> bytes:
    data = random.Random(seed).randbytes(size)
    (root / name).write_bytes(data)
    return data


def replace(path: Path, data: bytes) -> None:
    """Rewrite a file so that its validators surely change (new inode, later mtime)."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    later = path.stat().st_mtime + 10
    os.utime(tmp, (later, later))
    os.replace(tmp, path)


def with_http(fn: Callable[[HttpSource], Awaitable[T]], settings: SourceSettings = FAST) -> T:
    async def main() -> T:
        source = HttpSource(settings)
        try:
            return await fn(source)
        finally:
            await source.aclose()

    return trio.run(main)


async def read(source: Source, shard: ShardInfo, start: int = 0, end: int | None = None) -> bytes:
    end = shard.size if end is None else end
    parts = []
    async with aclosing(source.stream(shard, start, end)) as chunks:
        async for chunk in chunks:
            assert 0 < len(chunk) <= CHUNK
            parts.append(chunk)
    return b"".join(parts)


@contextlib.contextmanager
def proxy_for(server: Nginx) -> Iterator[FaultProxy]:
    with FaultProxy(server.port) as proxy:
        yield proxy


@contextlib.contextmanager
def http_server(handler: Callable[..., http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded http.server on 127.0.0.1 answering with `handler`; yields its URL."""

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # a client that closes early (shardfs after the probe) is not a failure

    server = Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def server_without_ranges(root: Path) -> Iterator[str]:
    """Python's http.server: answers every GET with the whole file (200)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    with http_server(functools.partial(Quiet, directory=str(root))) as url:
        yield url


# -- nginx helper ------------------------------------------------------------------------------


def test_nginx_serves_ranges_and_logs(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar", 1000)
    req = urllib.request.Request(f"{nginx.url}/a.tar", headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 206
        assert resp.read() == data[10:20]
        assert resp.headers["ETag"] and resp.headers["Last-Modified"]
    [record] = nginx.access_log()
    assert (record.method, record.uri, record.status) == ("GET", "/a.tar", 206)
    assert (record.bytes_sent, record.range) == (10, "bytes=10-19")
    nginx.reset_log()
    assert nginx.access_log() == []
    port = nginx.port
    nginx.restart()
    assert nginx.port == port and nginx.running
    with urllib.request.urlopen(f"{nginx.url}/a.tar") as resp:
        assert resp.read() == data
    assert [r.range for r in nginx.access_log()] == [None]


def test_nginx_latency_is_per_request_and_concurrent(tmp_path: Path) -> None:
    (tmp_path / "www").mkdir()
    data = put(tmp_path / "www", "a.tar", 5000)
    with Nginx(tmp_path / "www", tmp_path / "nginx", latency_s=1.0) as server:

        async def fetch_all(source: HttpSource) -> float:
            shard = await source.stat(f"{server.url}/a.tar")
            t0 = time.monotonic()
            results: list[bytes] = []

            async def one(i: int) -> None:
                results.append(await read(source, shard, i * 1000, i * 1000 + 1000))

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(one, i)
            assert sorted(results) == sorted(data[i * 1000 : i * 1000 + 1000] for i in range(5))
            return time.monotonic() - t0

        # A timeout well above the 1 s latency: on a loaded machine a 2 s one can fire.
        elapsed = with_http(fetch_all, SourceSettings(timeout=10.0, deadline=20.0))
        assert 1.0 <= elapsed < 4.0  # five delayed requests overlap (one after another: 5 s)
        assert all(r.status == 206 for r in server.access_log()[1:])


# -- HttpSource: stat --------------------------------------------------------------------------


def test_stat(nginx: Nginx) -> None:
    put(nginx.root, "a.tar")
    (nginx.root / "empty.tar").write_bytes(b"")

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{nginx.url}/a.tar")
        assert shard.size == SIZE and shard.url == f"{nginx.url}/a.tar"
        assert shard.etag and shard.etag.startswith('"') and shard.last_modified
        empty = await source.stat(f"{nginx.url}/empty.tar")
        assert empty.size == 0
        with pytest.raises(NotFound, match=r"/missing\.tar.*404"):
            await source.stat(f"{nginx.url}/missing.tar")
        assert source.stats.by_status == {206: 1, 200: 1, 404: 1}
        assert source.stats.requests == 3 and source.stats.retries == 0

    with_http(check)
    assert [r.range for r in nginx.access_log()] == ["bytes=0-0"] * 3


def test_stat_without_range_support(tmp_path: Path) -> None:
    """A server that ignores Range (200 with the whole file) gives a whole-only shard: its
    size from Content-Length, found without downloading it; streams send it from byte 0."""
    data = put(tmp_path, "a.tar")
    with server_without_ranges(tmp_path) as url:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{url}/a.tar")
            assert shard.whole_only and shard.size == SIZE and shard.last_modified
            # The whole shard was not downloaded just to find that out.
            assert source.stats.bytes_received < SIZE
            assert await read(source, shard) == data
            # Any span works (the bytes before it are skipped), though only whole reads pay.
            assert await read(source, shard, 1000, 5000) == data[1000:5000]

        with_http(check)


def test_stat_unreachable_then_back(nginx: Nginx) -> None:
    put(nginx.root, "a.tar")

    async def check(source: HttpSource) -> None:
        url = f"{nginx.url}/a.tar"
        await source.stat(url)
        nginx.stop()
        t0 = trio.current_time()
        with pytest.raises(Unreachable, match=r"a\.tar.*ConnectError"):
            await source.stat(url)
        # Not before the deadline; the upper bound only says "no hang" (generous under load).
        assert FAST.deadline <= trio.current_time() - t0 < FAST.deadline + FAST.timeout + 2.0
        assert source.stats.retries >= 5
        await trio.to_thread.run_sync(nginx.start)
        assert (await source.stat(url)).size == SIZE

    with_http(check)


def test_stat_retries_503_with_retry_after(nginx: Nginx) -> None:
    put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:
        proxy.fail(503, times=1, retry_after="1")

        async def check(source: HttpSource) -> None:
            t0 = trio.current_time()
            assert (await source.stat(f"{proxy.url}/a.tar")).size == SIZE
            assert 1.0 <= trio.current_time() - t0 < 3.0  # Retry-After: 1, not the 0.02 s backoff
            assert source.stats.by_status == {503: 1, 206: 1}

        with_http(check)


# -- HttpSource: stream ------------------------------------------------------------------------


def test_stream_is_byte_exact(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    (nginx.root / "empty.tar").write_bytes(b"")
    rng = random.Random(1)
    spans = [(0, SIZE), (0, 1), (SIZE - 1, SIZE), (CHUNK - 1, CHUNK + 1), (5, 5)]
    spans += [tuple(sorted((rng.randrange(SIZE), rng.randrange(SIZE)))) for _ in range(10)]

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{nginx.url}/a.tar")
        for start, end in spans:
            assert await read(source, shard, start, end) == data[start:end], (start, end)
        requests = source.stats.requests
        empty = await source.stat(f"{nginx.url}/empty.tar")
        assert await read(source, empty) == b""
        assert source.stats.requests == requests + 1  # the stat only
        with pytest.raises(ValueError):
            await read(source, shard, 10, SIZE + 1)
        assert source.stats.retries == 0 and source.stats.errors == 0

    with_http(check)
    log = nginx.access_log()
    assert {r.status for r in log} == {206, 200}
    assert sum(r.range == f"bytes=0-{SIZE - 1}" for r in log) == 1


def test_sequential_ranged_streams_reuse_one_connection(nginx: Nginx) -> None:
    """A ranged answer read to its last byte leaves its connection in the pool (reading it
    stopped just short of the body's end used to close it: one TCP connection per GET)."""
    data = put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            for start in range(0, 20 * 3000, 3000):
                assert await read(source, shard, start, start + 2500) == data[start:start + 2500]
            # A whole shard read over several chunks, then more ranges: still the same one.
            assert await read(source, shard) == data
            assert await read(source, shard, 7, 99) == data[7:99]

        with_http(check)
        assert proxy.connections_accepted == 1
        assert len(proxy.requests) == 23


def zeroed_part(tmp_path: Path) -> Path:
    """A file of SIZE zero bytes, as the reader's part file is before a download writes it."""
    target = tmp_path / "part"
    target.write_bytes(bytes(SIZE))
    return target


async def read_into(source: HttpSource, shard: ShardInfo, fd: int, start: int, end: int,
                    data: bytes) -> list[bytes | Written]:
    """Stream [start, end) of `shard` into `fd` with stream_into, checking that every piece
    is in the file at its offset, with the shard's bytes (`data`), when it is yielded."""
    pieces: list[bytes | Written] = []
    pos = start
    async with aclosing(source.stream_into(shard, start, end, fd)) as written:
        async for piece in written:
            if isinstance(piece, Written):
                assert piece.offset == pos
            assert os.pread(fd, len(piece), pos) == data[pos:pos + len(piece)]
            if isinstance(piece, bytes):
                assert piece == data[pos:pos + len(piece)]
            pieces.append(piece)
            pos += len(piece)
    assert pos == end
    return pieces


@pytest.fixture(params=["thread", "loop"])
def body_receiver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Spliced bodies received by a thread of C (`_bodysplice`, the default where it is
    built) or by the loop's thread (h1.BODIES_BY_THREAD off): the tests below hold for both."""
    if request.param == "thread":
        assert h1._bodysplice is not None, "shardfs/sources/_bodysplice.c is not built"
    monkeypatch.setattr(h1, "BODIES_BY_THREAD", request.param == "thread")
    return str(request.param)


@pytest.mark.parametrize("fault", ["none", "resets", "truncated", "stall"])
def test_http_stream_into_splices_plain_bodies_into_the_file(nginx: Nginx, tmp_path: Path,
                                                              fault: str,
                                                              body_receiver: str) -> None:
    """A plain http:// body goes from the socket into the file (splice): the pieces are
    `Written` (no bytes in Python), each in the file at its offset when yielded, the file
    byte-exact; a connection reset, a body cut short or a stall mid-body resumes from the
    last byte written, nothing fetched twice; the connection is reused afterwards."""
    data = put(nginx.root, "a.tar")
    target = zeroed_part(tmp_path)
    start = 12_345
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            if fault == "resets":
                proxy.reset_after(300_000, times=2)
            elif fault == "truncated":
                proxy.truncate_after(200_000, times=2)
            elif fault == "stall":
                proxy.stall(2.0, after_bytes=300_000, times=1)
            fd = os.open(target, os.O_RDWR)
            try:
                pieces = await read_into(source, shard, fd, start, SIZE, data)
                # Written: the bytes never came to the caller (those that came with an
                # answer's head were written by pwrite, the rest spliced)
                assert all(isinstance(p, Written) for p in pieces)
                assert 0 < source.stats.spliced_bytes <= SIZE - start
                assert source.stats.bytes_received == SIZE - start + 1  # + stat's 1 byte
                assert source.stats.retries == {"none": 0, "stall": 1}.get(fault, 2)
                before = proxy.connections_accepted
                assert await read(source, shard, 7, 99) == data[7:99]  # the pool's again
                assert proxy.connections_accepted == before
            finally:
                os.close(fd)

        with_http(check)
    assert target.read_bytes() == bytes(start) + data[start:]


def test_http_stream_into_writes_bytes_where_the_file_takes_no_splice(
        nginx: Nginx, tmp_path: Path, body_receiver: str) -> None:
    """A file that refuses splice writes (EINVAL: a file system without them; here a file
    opened for appending, which splice refuses and pwrite appends to, in order from 0) gets
    the bytes by pwrite, the download right; the source splices no more bodies."""
    data = put(nginx.root, "a.tar")
    target = tmp_path / "part"

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{nginx.url}/a.tar")
        for _ in range(2):
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
            try:
                async with aclosing(source.stream_into(shard, 0, SIZE, fd)) as pieces:
                    async for _piece in pieces:
                        pass
            finally:
                os.close(fd)
            assert target.read_bytes() == data
        assert source.stats.spliced_bytes == 0
        assert source.stats.retries == 0

    with_http(check)


def test_http_stream_into_raises_a_failed_write_as_oserror(nginx: Nginx, tmp_path: Path,
                                                           body_receiver: str) -> None:
    """A write into the file that fails (a full disk; here a descriptor open only for
    reading) is raised as the OSError it is, not retried as the server's failure."""
    data = put(nginx.root, "a.tar")
    target = zeroed_part(tmp_path)

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{nginx.url}/a.tar")
        fd = os.open(target, os.O_RDONLY)
        try:
            with pytest.raises(OSError) as raised:
                await read_into(source, shard, fd, 0, SIZE, data)
            assert not isinstance(raised.value, SourceError)
            assert source.stats.retries == 0
        finally:
            os.close(fd)

    with_http(check)


def test_a_plain_body_is_spliced_by_a_thread_of_c_not_the_loop(
        nginx: Nginx, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `_bodysplice` is built, the loop's thread makes no splice of a download's
    body (the thread of C does both: socket to pipe, pipe to file); the file is byte-exact
    and the bytes counted as spliced."""
    assert h1._bodysplice is not None, "shardfs/sources/_bodysplice.c is not built"
    monkeypatch.setattr(h1, "BODIES_BY_THREAD", True)
    data = put(nginx.root, "a.tar", 8 << 20)
    target = tmp_path / "part"
    target.write_bytes(bytes(len(data)))
    splices: list[int] = []
    real_splice = os.splice

    def counted(*args: Any, **kwargs: Any) -> int:
        splices.append(threading.get_ident())
        return real_splice(*args, **kwargs)

    monkeypatch.setattr(os, "splice", counted)

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{nginx.url}/a.tar")
        fd = os.open(target, os.O_RDWR)
        try:
            pieces = await read_into(source, shard, fd, 0, len(data), data)
        finally:
            os.close(fd)
        assert all(isinstance(p, Written) for p in pieces)
        assert source.stats.spliced_bytes >= len(data) - h1.SPLICED_HEAD_RECEIVE

    with_http(check)
    assert splices == []
    assert target.read_bytes() == data


def test_a_body_left_mid_way_frees_its_thread(nginx: Nginx, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A download cancelled while its body stalls (its thread of C waiting in poll) is left
    at once: nothing is written after, and the same kept thread (seen while the body came)
    takes the next body, which it could not while still waiting on the stalled one."""
    assert h1._bodysplice is not None, "shardfs/sources/_bodysplice.c is not built"
    monkeypatch.setattr(h1, "BODIES_BY_THREAD", True)
    data = put(nginx.root, "a.tar")
    target = zeroed_part(tmp_path)

    def body_threads() -> set[str]:
        return {comm.parent.name for comm in Path("/proc/self/task").glob("*/comm")
                if comm.read_text().strip() == h1._bodysplice.THREAD_NAME}

    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            proxy.stall(30.0, after_bytes=300_000, times=1)
            fd = os.open(target, os.O_RDWR)
            got, seen = 0, set()
            try:
                began = time.monotonic()
                with trio.move_on_after(0.6) as scope:
                    async with aclosing(source.stream_into(shard, 0, SIZE, fd)) as pieces:
                        async for piece in pieces:
                            got += len(piece)
                            seen |= body_threads()
                # Left when cancelled, not when the stall (30 s) or the timeout (60 s) ends.
                assert time.monotonic() - began < 15
                assert scope.cancelled_caught and 0 < got < SIZE
                await trio.sleep(0.2)
                on_disk = os.pread(fd, SIZE, 0)
                assert on_disk[:got] == data[:got]
                assert on_disk[310_000:] == bytes(SIZE - 310_000)  # nothing past the stall
                # The next body: the stalled one's thread takes it, no second thread.
                await read_into(source, shard, fd, 0, SIZE, data)
                assert len(seen) == 1 and body_threads() == seen, (seen, body_threads())
            finally:
                os.close(fd)
            assert await read(source, shard, 7, 99) == data[7:99]

        with_http(check, dataclasses.replace(FAST, timeout=60.0, deadline=120.0))


def settled(receiver: Any, within_s: float) -> int:
    """How a `_bodysplice` receiver ended (its state), waited for at most `within_s`
    (pytest.fail after that)."""
    assert h1._bodysplice is not None
    deadline = time.monotonic() + within_s
    state = h1._bodysplice.RUNNING
    while state == h1._bodysplice.RUNNING:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([receiver.fileno()], [], [], left)[0]:
            pytest.fail(f"the body did not end within {within_s} s")
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(receiver.fileno())
        state = receiver.progress()[2]
    return state


def test_bodies_started_at_once_each_get_a_thread(tmp_path: Path) -> None:
    """More bodies started back to back than there are idle kept threads: none waits for a
    thread another body took. Here all the kept threads and one more are held by bodies that
    stall (no byte comes), and the body started last, whose bytes are all there, is received
    while they still wait. The module alone, over socket pairs."""
    bodysplice = h1._bodysplice
    assert bodysplice is not None, "shardfs/sources/_bodysplice.c is not built"
    fd = os.open(tmp_path / "part", os.O_RDWR | os.O_CREAT, 0o600)
    pairs: list[tuple[socket.socket, socket.socket]] = []

    def body(count: int, timeout_ms: int) -> tuple[Any, socket.socket]:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        pairs.append((ours, theirs))
        return bodysplice.start(ours.fileno(), fd, 0, count, timeout_ms, 1 << 16), theirs

    try:
        warm, theirs = body(10, 5000)  # at least one kept thread, idle once this ends
        theirs.sendall(bytes(10))
        assert settled(warm, 10.0) == bodysplice.DONE
        warm.stop()
        kept = sum(1 for comm in Path("/proc/self/task").glob("*/comm")
                   if comm.read_text().strip() == bodysplice.THREAD_NAME)
        stalled = [body(1000, 30_000)[0] for _ in range(kept + 1)]
        last, theirs = body(100_000, 30_000)
        theirs.sendall(random.Random(5).randbytes(100_000))
        assert settled(last, 10.0) == bodysplice.DONE
        last.stop()
        assert [r.progress()[2] for r in stalled] == [bodysplice.RUNNING] * len(stalled)
        for r in stalled:
            r.stop()
            assert r.progress()[2] == bodysplice.STOPPED
    finally:
        os.close(fd)
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_a_forked_child_receives_bodies_without_its_parents_kept_threads(
        tmp_path: Path) -> None:
    """The threads a process keeps for bodies are not in a child it forks (the daemon forks
    its worker zygote): there a body gets a thread of its own, not a wait for one that is not
    there. The module alone, over a socket pair."""
    bodysplice = h1._bodysplice
    assert bodysplice is not None, "shardfs/sources/_bodysplice.c is not built"

    def receive(payload: bytes, path: Path) -> tuple[int, bytes]:
        ours, theirs = socket.socketpair()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            ours.setblocking(False)
            receiver = bodysplice.start(ours.fileno(), fd, 0, len(payload), 5000, 1 << 16)
            theirs.sendall(payload)
            state = settled(receiver, 10.0)
            receiver.stop()
            return state, os.pread(fd, len(payload) + 1, 0)
        finally:
            os.close(fd)
            ours.close()
            theirs.close()

    payload = random.Random(4).randbytes(200_000)
    assert receive(payload, tmp_path / "parent") == (bodysplice.DONE, payload)  # a kept thread
    child = os.fork()
    if child == 0:  # no pytest in here: the exit status says
        status = 1
        try:
            signal.alarm(20)  # a child waiting for a thread that is not there ends here
            status = 0 if receive(payload, tmp_path / "child") == (bodysplice.DONE,
                                                                   payload) else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_stream_receives_more_than_httpcore_default_at_a_time(
        nginx: Nginx, monkeypatch: pytest.MonkeyPatch) -> None:
    """sources/http.py raises httpcore's receive size from 64 KiB: a body that piles up in
    the socket while the consumer is busy comes in larger pieces, byte-exact. If a new
    httpcore drops the constant, this fails and says so (the CPU saving is then gone)."""
    assert hasattr(httpcore.AsyncHTTP11Connection, "READ_NUM_BYTES"), "gone from httpcore"
    # As a fresh process has it (another test's HttpSource raised it already):
    monkeypatch.setattr(httpcore.AsyncHTTP11Connection, "READ_NUM_BYTES", 64 * 1024)
    data = put(nginx.root, "big.tar", 8 << 20)
    sizes: list[int] = []

    async def check(source: HttpSource) -> bytes:
        # Building the source raised it:
        assert httpcore.AsyncHTTP11Connection.READ_NUM_BYTES == HTTP_RECEIVE_BYTES
        shard = await source.stat(f"{nginx.url}/big.tar")
        parts = []
        async with aclosing(source.stream(shard, 0, shard.size)) as chunks:
            async for chunk in chunks:
                sizes.append(len(chunk))
                parts.append(chunk)
                await trio.sleep(0.005)  # a busy consumer: the socket buffer fills meanwhile
        return b"".join(parts)

    assert with_http(check, SourceSettings(chunk_size=4 << 20)) == data
    assert max(sizes) > 64 * 1024, sizes[:20]


def test_stream_sends_validators(nginx: Nginx) -> None:
    put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            await read(source, shard, 100, 200)
            sent = proxy.requests[-1].headers
            assert sent["range"] == "bytes=100-199" and sent["if-match"] == shard.etag
            dated = ShardInfo(shard.url, shard.size, None, shard.last_modified)
            await read(source, dated, 100, 200)
            assert proxy.requests[-1].headers["if-unmodified-since"] == shard.last_modified

        with_http(check)


def test_stream_resumes_after_resets(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:
        proxy.reset_after(100_000)

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")  # 1 byte: not cut
            assert await read(source, shard) == data
            assert source.stats.retries >= 9
            assert source.stats.bytes_received == SIZE + 1  # nothing fetched twice

        with_http(check)
        starts = [int(r.headers["range"][6:].split("-")[0]) for r in proxy.requests[1:]]
        assert starts == sorted(set(starts)) and starts[0] == 0 and len(starts) >= 10


def test_stream_resumes_after_truncated_bodies(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            proxy.truncate_after(50_000, times=2)
            assert await read(source, shard, 7, SIZE - 7) == data[7 : SIZE - 7]
            assert source.stats.retries == 2 and source.stats.bytes_received == SIZE - 14 + 1

        with_http(check)


@pytest.mark.parametrize("retry_after", [None, "1"])
def test_stream_retries_503_bursts(nginx: Nginx, retry_after: str | None) -> None:
    data = put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            proxy.fail(503, times=3, retry_after=retry_after)
            t0 = trio.current_time()
            assert await read(source, shard) == data
            elapsed = trio.current_time() - t0
            assert source.stats.by_status[503] == 3 and source.stats.retries == 3
            if retry_after is None:
                assert elapsed < 2.5  # backoff 0.02 + 0.04 + 0.08, not 3 x Retry-After
            else:
                assert 3.0 <= elapsed < 6.0

        with_http(check, dataclasses.replace(FAST, deadline=10.0))


def test_stream_recovers_from_stalls(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            proxy.stall(5.0, times=1)  # before the response head
            t0 = trio.current_time()
            assert await read(source, shard) == data
            assert FAST.timeout <= trio.current_time() - t0 < 4.0  # retried, did not sit it out
            proxy.stall(2.0, after_bytes=300_000, times=1)  # mid-body
            assert await read(source, shard) == data
            assert source.stats.retries == 2
            assert source.stats.bytes_received == 2 * SIZE + 1

        with_http(check)


def test_stream_survives_outage_shorter_than_deadline(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:

        async def come_back() -> None:
            await trio.sleep(1.0)
            await trio.to_thread.run_sync(proxy.accept_connections)

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            proxy.stall(30.0, after_bytes=CHUNK, times=1)  # keep the transfer going
            parts = []
            stream = source.stream(shard, 0, SIZE)
            async with trio.open_nursery() as nursery, aclosing(stream) as chunks:
                async for chunk in chunks:
                    parts.append(chunk)
                    if len(parts) == 1:
                        proxy.refuse_connections()  # also drops the connection in use
                        nursery.start_soon(come_back)
            assert b"".join(parts) == data
            assert source.stats.retries >= 3

        with_http(check)


def test_stream_unreachable_past_deadline(nginx: Nginx) -> None:
    put(nginx.root, "a.tar")
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            proxy.stall(30.0)  # the server accepts but never answers
            t0 = trio.current_time()
            with pytest.raises(Unreachable, match=r"a\.tar.*deadline.*ReadTimeout"):
                await read(source, shard)
            assert FAST.deadline <= trio.current_time() - t0 < FAST.deadline + FAST.timeout + 2.0
            proxy.clear()
            assert len(await read(source, shard, 0, 10)) == 10

        with_http(check)


def test_url_already_past_its_deadline_fails_fast_then_recovers(nginx: Nginx) -> None:
    """A second operation on a URL that just went a whole deadline without progress gets a
    short grace (one request timeout of retries), not a new deadline: the kernel retries a
    failed page read at once, which used to double the time to EIO (issue #7). Once the
    server answers again, the next operation succeeds and the full deadline is back."""
    data = put(nginx.root, "a.tar")
    put(nginx.root, "b.tar", seed=1)
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            other = await source.stat(f"{proxy.url}/b.tar")
            proxy.refuse_connections()
            t0 = trio.current_time()
            with pytest.raises(Unreachable, match=r"a\.tar.*deadline"):
                await read(source, shard)
            assert FAST.deadline <= trio.current_time() - t0 < FAST.deadline + 2.0
            t1 = trio.current_time()
            with pytest.raises(Unreachable, match=r"a\.tar: unreachable, no progress for [3-9]"):
                await read(source, shard, 0, 10)
            assert trio.current_time() - t1 < FAST.timeout + 1.5  # not a new deadline (3 s)
            t2 = trio.current_time()  # another URL has its own deadline
            with pytest.raises(Unreachable, match=r"b\.tar"):
                await read(source, other, 0, 10)
            assert trio.current_time() - t2 >= FAST.deadline
            await trio.to_thread.run_sync(proxy.accept_connections)
            assert await read(source, shard) == data
            # Progress restored the full deadline: an outage shorter than it is survived.
            await trio.to_thread.run_sync(proxy.refuse_connections)

            async def back_later() -> None:
                await trio.sleep(FAST.timeout + 0.5)
                await trio.to_thread.run_sync(proxy.accept_connections)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(back_later)
                assert await read(source, shard, 0, 10) == data[:10]

        with_http(check)


def test_slow_consumer_is_not_a_stall(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    settings = dataclasses.replace(FAST, deadline=0.5)
    with proxy_for(nginx) as proxy:
        proxy.reset_after(200_000, times=1)

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            parts = []
            async with aclosing(source.stream(shard, 0, SIZE)) as chunks:
                async for chunk in chunks:
                    if not parts:
                        await trio.sleep(1.0)  # longer than the deadline
                    parts.append(chunk)
            assert b"".join(parts) == data

        with_http(check, settings)


def test_stream_detects_changed_shard(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")

    async def check(source: HttpSource) -> None:
        shard = await source.stat(f"{nginx.url}/a.tar")
        replace(nginx.root / "a.tar", data[::-1])  # same size, new ETag
        with pytest.raises(ShardChanged, match=r"a\.tar"):
            await read(source, shard)
        dated = ShardInfo(shard.url, shard.size, None, shard.last_modified)
        with pytest.raises(ShardChanged):  # If-Unmodified-Since catches it as well
            await read(source, dated)
        fresh = await source.stat(shard.url)
        assert fresh.etag != shard.etag
        replace(nginx.root / "a.tar", data + b"more")
        with pytest.raises(ShardChanged):
            await read(source, fresh, 0, 10)
        (nginx.root / "a.tar").unlink()
        with pytest.raises(NotFound):
            await read(source, fresh, 0, 10)

    with_http(check)
    assert [r.status for r in nginx.access_log()][1:3] == [412, 412]


def test_early_close_and_cancel_release_the_connection(nginx: Nginx) -> None:
    data = put(nginx.root, "a.tar")
    settings = dataclasses.replace(FAST, max_connections=1)
    with proxy_for(nginx) as proxy:

        async def check(source: HttpSource) -> None:
            shard = await source.stat(f"{proxy.url}/a.tar")
            with trio.fail_after(5):
                for _ in range(3):
                    async with aclosing(source.stream(shard, 0, SIZE)) as chunks:
                        async for _chunk in chunks:
                            break
                proxy.stall(10.0, after_bytes=CHUNK, times=1)
                with trio.move_on_after(0.3) as scope:
                    await read(source, shard)
                assert scope.cancelled_caught
                assert await read(source, shard) == data  # the single connection is free

        with_http(check, settings)


def test_fetch_optional_http(nginx: Nginx) -> None:
    (nginx.root / "a.idx").write_bytes(b"index")

    async def check(source: HttpSource) -> None:
        assert await source.fetch_optional(f"{nginx.url}/a.idx") == b"index"
        assert await source.fetch_optional(f"{nginx.url}/b.idx") is None
        nginx.stop()
        with pytest.raises(Unreachable):
            await source.fetch_optional(f"{nginx.url}/a.idx")

    with_http(check)


# -- FileSource --------------------------------------------------------------------------------


def with_file(fn: Callable[[FileSource], Awaitable[T]]) -> T:
    return trio.run(fn, FileSource(FAST))


def test_file_stat_and_stream(tmp_path: Path) -> None:
    data = put(tmp_path, "a b%#.tar")
    (tmp_path / "empty.tar").write_bytes(b"")
    url = to_url(str(tmp_path / "a b%#.tar"))
    assert "%20" in url and "%25" in url and "%23" in url

    async def check(source: FileSource) -> None:
        shard = await source.stat(url)
        st = (tmp_path / "a b%#.tar").stat()
        assert shard == ShardInfo(url, SIZE, f"{st.st_ino:x}-{st.st_mtime_ns:x}-{SIZE:x}")
        for start, end in [(0, SIZE), (3, 4), (CHUNK - 1, 3 * CHUNK + 5), (9, 9)]:
            assert await read(source, shard, start, end) == data[start:end]
        empty = await source.stat(to_url(str(tmp_path / "empty.tar")))
        assert empty.size == 0 and await read(source, empty) == b""
        with pytest.raises(NotFound, match="missing"):
            await source.stat(to_url(str(tmp_path / "missing.tar")))
        with pytest.raises(SourceError, match="directory"):
            await source.stat(to_url(str(tmp_path)))
        replace(tmp_path / "a b%#.tar", data[::-1])
        with pytest.raises(ShardChanged):
            await read(source, shard)

    with_file(check)


def test_file_stream_into_writes_what_it_yields_at_its_offsets(tmp_path: Path) -> None:
    """FileSource.stream_into (the reader's cache file written by the reading thread): each
    piece is in the target file at its offset before it is yielded; a write that fails (a
    full disk, here a descriptor open only for reading) is raised as the OSError it is."""
    data = put(tmp_path, "s.tar")
    url = to_url(str(tmp_path / "s.tar"))
    target = tmp_path / "part"
    target.write_bytes(bytes(SIZE))

    async def check(source: FileSource) -> None:
        shard = await source.stat(url)
        start = CHUNK - 1
        fd = os.open(target, os.O_RDWR)
        try:
            pos = start
            async with aclosing(source.stream_into(shard, start, SIZE, fd)) as pieces:
                async for piece in pieces:
                    assert os.pread(fd, len(piece), pos) == piece == data[pos:pos + len(piece)]
                    pos += len(piece)
            assert pos == SIZE
        finally:
            os.close(fd)
        assert target.read_bytes() == bytes(start) + data[start:]
        fd = os.open(target, os.O_RDONLY)
        try:
            with pytest.raises(OSError) as raised:
                async with aclosing(source.stream_into(shard, 0, SIZE, fd)) as pieces:
                    async for _ in pieces:
                        pass
            assert not isinstance(raised.value, SourceError)
        finally:
            os.close(fd)

    with_file(check)


def test_file_fetch_optional(tmp_path: Path) -> None:
    (tmp_path / "a.idx").write_bytes(b"index")

    async def check(source: FileSource) -> None:
        assert await source.fetch_optional(to_url(str(tmp_path / "a.idx"))) == b"index"
        assert await source.fetch_optional(to_url(str(tmp_path / "b.idx"))) is None
        with pytest.raises(SourceError):
            await source.fetch_optional(to_url(str(tmp_path)))

    with_file(check)


# -- Sources, to_url ---------------------------------------------------------------------------


def test_to_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert to_url("shards/a.tar") == f"file://{tmp_path}/shards/a.tar"
    assert to_url("./x/../a b.tar") == f"file://{tmp_path}/a%20b.tar"
    assert to_url("/data/a.tar") == "file:///data/a.tar"
    for url in ("http://h/a.tar", "https://h:8/a%20.tar?x=1", "file:///a.tar", "s3://b/a.tar"):
        assert to_url(url) == url


def test_sources_dispatch_and_stats(nginx: Nginx, tmp_path: Path) -> None:
    data = put(nginx.root, "a.tar", 1000)
    local = tmp_path / "a.tar"
    local.write_bytes(data)

    async def check() -> None:
        sources = Sources(FAST)
        try:
            http_source = sources.for_url(f"{nginx.url}/a.tar")
            assert isinstance(http_source, HttpSource)
            assert sources.for_url("https://example.invalid/x") is http_source
            file_source = sources.for_url(to_url(str(local)))
            assert isinstance(file_source, FileSource)
            for bad in ("abfs://container/a.tar", "a.tar"):
                with pytest.raises(SourceError, match=r"unsupported.*http://.*file://"):
                    sources.for_url(bad)
            pairs = ((http_source, f"{nginx.url}/a.tar"), (file_source, to_url(str(local))))
            for source, url in pairs:
                shard = await source.stat(url)
                assert await read(source, shard) == data
            total = sources.stats()
            assert total.requests == 4 and total.bytes_received == 2 * 1000 + 1
            assert total.by_status == {206: 2}
        finally:
            await sources.aclose()

    trio.run(check)
