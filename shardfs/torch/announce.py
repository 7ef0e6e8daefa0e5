"""Talking to a mount's announce socket from a training process (shardfs/daemon/announce.py
is the daemon's side and documents the protocol).

`AnnounceLink` is one connection; `MountLocator` finds, for a file path, the announce socket of
the shardfs mount holding it and the path relative to that mount's root; `ShardsAhead` tells the
daemon which shards a shard-aware sampler reads next, so it fetches them whole, in that order,
before the sampler's readers reach them. Announcements only steer prefetching: when they fail,
training reads on as if they had never been sent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)
STATS_XATTR = "user.shardfs.stats"
TIMEOUT_S = 10.0
SHARDS_AHEAD = 8  # shards told beyond the sampler's window (the daemon's fetch slots)
# Replies to `shards` messages are read in bulk, this many at a time: waiting for each would
# stall the DataLoader's main process (which runs the sampler) on the daemon's loop.
REPLIES_OWED = 32


class AnnounceLink:
    """One connection to a daemon's announce socket, owned by the process that opened it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.pid = os.getpid()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(TIMEOUT_S)
        try:
            self.sock.connect("\0" + address[1:] if address.startswith("@") else address)
        except OSError:
            self.sock.close()
            raise
        self._buf = b""
        self.owed = 0  # replies to messages posted and not read yet

    def post(self, message: dict[str, Any]) -> None:
        """Send a message without waiting for its reply (read by the next collect()): the
        sampler goes on while the daemon resolves the paths."""
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        self.owed += 1

    def collect(self) -> list[dict[str, Any]]:
        """The replies owed, in order; ConnectionError if one is an error."""
        replies = []
        while self.owed:
            while b"\n" not in self._buf:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionError("the daemon closed the announce connection")
                self._buf += chunk
            line, _, self._buf = self._buf.partition(b"\n")
            self.owed -= 1
            reply = json.loads(line)
            if "error" in reply:
                raise ConnectionError(reply["error"])
            replies.append(reply)
        return replies

    def close(self) -> None:
        self.sock.close()


class MountLocator:
    """Path -> (announce socket, path relative to its mount root), remembered per directory
    and per mount root (a stats xattr read per mount, a mount-point walk per directory)."""

    def __init__(self) -> None:
        self._where: dict[str, tuple[str, str] | None] = {}  # directory -> (socket, rel dir)
        self._roots: dict[str, str | None] = {}  # mount root -> its announce socket

    def locate(self, path: str) -> tuple[str, str] | None:
        """(announce socket, path relative to its mount root), or None: not on a mount with
        an announce socket."""
        directory, name = os.path.split(path)
        where = self._where.get(directory, ...)
        if where is ...:
            where = self._where[directory] = self._dir_location(directory)
        if where is None:
            return None
        address, rel_dir = where
        return address, (f"{rel_dir}/{name}" if rel_dir else name)

    def _dir_location(self, directory: str) -> tuple[str, str] | None:
        full = os.path.abspath(directory)
        root = full
        while not os.path.ismount(root) and root != "/":
            root = os.path.dirname(root)
        if root not in self._roots:
            address = None
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                address = json.loads(os.getxattr(root, STATS_XATTR)).get("lookahead_socket")
            self._roots[root] = address if isinstance(address, str) else None
        address = self._roots[root]
        if address is None:
            return None
        rel = os.path.relpath(full, root)
        return address, "" if rel == "." else rel


def announce_shards(order: Sequence[int], firsts: Sequence[int], paths: Sequence[str],
                    lead: int) -> Iterator[int]:
    """Yield `order` unchanged, telling the daemon of each shard `lead` shards before the
    iteration reaches it. `firsts` are the positions in `order` where a shard is met first,
    ascending (so shards are counted in the order the iteration meets them). What it tells is
    one file of the shard; the daemon fetches the shard whole (Reader.queue_ahead)."""
    if not firsts or lead <= 0:
        yield from order
        return
    sender = _ShardSender()
    try:
        sender.send([paths[order[p]] for p in firsts[:lead]])
        k, n = 0, len(firsts)
        next_first = firsts[0]
        for pos, index in enumerate(order):
            if pos == next_first:
                if k + lead < n:
                    sender.send([paths[order[firsts[k + lead]]]])
                k += 1
                next_first = firsts[k] if k < n else -1
            yield index
    finally:
        sender.close()


class _ShardSender:
    """The `{"shards": [...]}` messages of one iteration, to whichever mounts hold the files;
    a mount whose socket fails is left alone for the rest of the iteration."""

    def __init__(self) -> None:
        self.locator = MountLocator()
        self.links: dict[str, AnnounceLink] = {}
        self.dead: set[str] = set()

    def send(self, paths: list[str]) -> None:
        per_socket: dict[str, list[str]] = {}
        for path in paths:
            where = self.locator.locate(path)
            if where is not None and where[0] not in self.dead:
                per_socket.setdefault(where[0], []).append(where[1])
        for address, rels in per_socket.items():
            try:
                link = self.links.get(address)
                if link is None:
                    link = self.links[address] = AnnounceLink(address)
                if link.owed >= REPLIES_OWED:
                    link.collect()
                link.post({"shards": rels})
            except (OSError, ValueError) as exc:
                self._give_up(address, exc)

    def close(self) -> None:
        for address, link in list(self.links.items()):
            try:
                link.collect()
            except (OSError, ValueError) as exc:
                self._give_up(address, exc)
            link.close()
        self.links.clear()

    def _give_up(self, address: str, exc: Exception) -> None:
        self.dead.add(address)
        link = self.links.pop(address, None)
        if link is not None:
            link.close()
        log.info("cannot announce shards to the shardfs daemon at %s (%s); the sampler's "
                 "shards are fetched when first read", address, exc)
