"""The announce socket: training processes tell the daemon which files they will read next.

`shardfs.torch.Lookahead` connects to `@shardfs/<hash of the cache dir>.lookahead` (Linux's
abstract namespace; the name is in the mount's stats xattr as `lookahead_socket`) and keeps the
connection open for as long as it iterates. Each line it sends is a JSON object:

    {"paths": ["train/n01/x.jpg", ...]}   append these files (relative to the mount root)
    {"reset": true, "paths": [...]}       forget what this connection announced, then append
    {"paths": [...], "last": true}        append; the epoch is now announced to its end (when
                                          the dataset fits the cache, the shards' last bytes
                                          are fetched once nothing announced is left)
    {"shards": ["train/n01/x.jpg", ...]}  the shards holding these files are read next, in
                                          this order (ShardAwareSampler): fetch them whole

and each gets one JSON line back: `{"accepted": N, "refused": N, "unknown": N, "pending": N}`
(refused: over the per-connection cap; unknown: not a file of the mount), for "shards"
`{"queued": N, "unknown": N}` (queued: shards newly awaited, not cached, fetching or announced
already; fetched whole in that order, two at a time, and only when the dataset fits the cache:
otherwise none are; see Reader.queue_ahead), or `{"error": ...}`.
Closing the connection drops its announcements (fetches already started finish).

Who may announce: anyone who may read the mount — the daemon's own user, root, and, when the
mount has allow_other, every user (checked with SO_PEERCRED when the connection opens). An
announcement can only make the daemon fetch bytes of the mounted dataset ahead of time within
a fixed RAM budget, and each connection is capped (`max_pending` entries, `MAX_LINE` bytes per
line), so a careless or hostile client costs bandwidth, never memory beyond those bounds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, Protocol

import trio

from shardfs.catalog.shardindex import KIND_FILE
from shardfs.catalog.tree import Tree
from shardfs.daemon.control import bind_when_free, control_address, peer_credentials
from shardfs.read.lookahead import Lookahead, LookaheadPolicy, Stream
from shardfs.read.reader import Reader
from shardfs.sources import SourceError

log = logging.getLogger(__name__)
MAX_LINE = 4 << 20  # bytes in one announcement line (~40k paths)
# Paths resolved and announced between two checkpoints of the loop: a window's 2,000 take
# ~20 ms, which would otherwise hold back the GETs of the window's head and every FUSE read.
SLICE = 256
_DIRS_KEPT = 1 << 16  # directories whose inode the resolver remembers


class ShardsAhead(Protocol):
    """What the announce socket asks of the reader for `{"shards": [...]}` messages."""

    def queue_ahead(self, shards: Sequence[int], owner: Hashable) -> int: ...

    def forget_ahead(self, owner: Hashable) -> None: ...


def announce_address(cache_dir: str) -> str:
    return control_address(cache_dir) + ".lookahead"


def attach_lookahead(reader: Reader, policy: LookaheadPolicy) -> Lookahead | None:
    """A Lookahead for a mount's reader (None when disabled: buffer_bytes 0), hooked into it."""
    if policy.buffer_bytes <= 0:
        return None
    catalog, cache = reader.catalog, reader.cache

    def covered(shard: int) -> bool:
        """The reader serves this shard without member reads: leave it to whole-shard caching."""
        fetch = reader.fetches.get(shard)
        return (reader.codecs[shard] is not None or (fetch is not None and not fetch.fill)
                or cache.has(catalog.keys[shard]))

    def fits() -> bool:
        """The dataset fits the cache: announced members go into their shards' part files
        (or, with fill_parts off, only the epoch's first entries are fetched ahead)."""
        return reader.dataset_bytes <= cache.budget

    lookahead = Lookahead(catalog.shards, reader.sources, policy, covered=covered, fits=fits,
                          parts=reader)
    reader.lookahead = lookahead
    # Make the HTTP client (~50 ms of CPU) now rather than in the way of the first GETs.
    http = next((s.url for s in catalog.shards if s.url.startswith(("http:", "https:"))), None)
    if http is not None:
        with contextlib.suppress(SourceError):
            reader.sources.for_url(http)
    return lookahead


def resolver(tree: Tree) -> Callable[[str], tuple[int, int, int] | None]:
    """Path relative to the mount root -> (shard, offset, size) of a regular file, or None."""
    # A window of paths names few directories many times: each is looked up once (bounded,
    # for trees of very many directories), and only the file's name per path.
    dirs: dict[bytes, int | None] = {}

    def resolve(path: str) -> tuple[int, int, int] | None:
        if not isinstance(path, str):
            return None
        raw = os.fsencode(path).strip(b"/")
        if not raw or b".." in raw.split(b"/"):
            return None
        head, _, name = raw.rpartition(b"/")
        try:
            parent = dirs[head]
        except KeyError:
            if len(dirs) >= _DIRS_KEPT:
                dirs.clear()
            parent = dirs[head] = tree.resolve(head)
        if parent is None:
            return None
        ino = parent if name == b"." else tree.lookup(parent, name)
        if ino is None or tree.kind[ino - 1] != KIND_FILE:
            return None
        ref = tree.file_ref(ino)
        # The bytes it takes in its shard (compressed or sparse members: fewer than its size)
        return ref.shard, ref.offset, tree.stored_size(ino)

    return resolve


async def serve_announcements(address: str, lookahead: Lookahead, tree: Tree, *,
                              allow_other: bool, shards_ahead: ShardsAhead,
                              patient_s: float = 0.0,
                              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                              ) -> None:
    """Run the Lookahead and answer announcing connections until cancelled."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if not await bind_when_free(sock, address, patient_s):
        sock.close()
        return
    sock.listen(64)
    listener = trio.SocketListener(sock)
    resolve = resolver(tree)
    owner = os.getuid()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(lookahead.run)
            task_status.started()

            async def one(stream: trio.SocketStream) -> None:
                async with stream:
                    pid, uid = peer_credentials(stream.socket)
                    if not (allow_other or uid in (0, owner)):
                        await _reply(stream, {"error": f"permission denied: uid {uid} may not "
                                              "read this mount (it has no allow_other)"})
                        return
                    conn = object()  # owns this connection's announced shards
                    try:
                        await _converse(stream, lookahead.open_stream(f"pid {pid} uid {uid}"),
                                        resolve, partial(shards_ahead.queue_ahead, owner=conn))
                    finally:
                        shards_ahead.forget_ahead(conn)

            while True:
                nursery.start_soon(one, await listener.accept())
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()


async def _reply(stream: trio.SocketStream, message: dict[str, Any]) -> None:
    await stream.send_all(json.dumps(message).encode() + b"\n")


async def _converse(sock: trio.SocketStream, stream: Stream,
                    resolve: Callable[[str], tuple[int, int, int] | None],
                    queue_shards: Callable[[list[int]], int]) -> None:
    buf = bytearray()
    try:
        while True:
            newline = buf.find(b"\n")
            if newline < 0:
                if len(buf) > MAX_LINE:
                    await _reply(sock, {"error": f"announcement line over {MAX_LINE} bytes"})
                    return
                try:
                    chunk = await sock.receive_some(1 << 16)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not chunk:
                    return
                buf += chunk
                continue
            line = bytes(buf[:newline])
            del buf[: newline + 1]
            try:
                response = await _handle(line, stream, resolve, queue_shards)
            except (ValueError, TypeError) as exc:
                response = {"error": f"bad announcement: {exc}"}
            try:
                await _reply(sock, response)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
    finally:
        stream.close()


async def _handle(line: bytes, stream: Stream,
                  resolve: Callable[[str], tuple[int, int, int] | None],
                  queue_shards: Callable[[list[int]], int]) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("expected a JSON object")
    if "shards" in message:
        paths = message["shards"]
        if not isinstance(paths, list):
            raise ValueError("shards must be a list of strings")
        refs = [resolve(p) for p in paths]
        shards = list(dict.fromkeys(r[0] for r in refs if r is not None))
        return {"queued": queue_shards(shards), "unknown": sum(r is None for r in refs)}
    if message.get("reset"):
        stream.reset()
    paths = message.get("paths") or []
    if not isinstance(paths, list):
        raise ValueError("paths must be a list of strings")
    accepted = refused = unknown = 0
    for at in range(0, len(paths), SLICE):
        if at:  # the GETs of what is announced so far start meanwhile
            await trio.lowlevel.checkpoint()
        refs = [resolve(p) for p in paths[at : at + SLICE]]
        missing = sum(r is None for r in refs)
        unknown += missing
        stream.owner.stats.unknown += missing
        took, over = stream.announce(r for r in refs if r is not None)
        accepted += took
        refused += over
    if message.get("last"):
        stream.announced_all()
    return {"accepted": accepted, "refused": refused, "unknown": unknown,
            "pending": stream.live}
