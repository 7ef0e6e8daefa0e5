"""`shardfs csi-mounter`: serves FUSE mounts the node plugin made, one daemon per volume.

Needs no privilege: it never mounts, it only runs `shardfs mount --fuse-fd N` on descriptors
the plugin hands over its socket. Requests (one per connection, `wire` messages):

- `serve` {key, spec, secrets, node_path, token} + fd -> {ok} once the daemon is ready, or
  {ok: false, error: "shardfs: error: ...", code}
- `token` {key, token} -> {ok}: a pod's newer service account token for a volume with
  pod-level credentials (kubelet's republish): written where the daemon reads it
- `release` {key} -> {ok}: the plugin unmounted the volume; end its daemon, close the fd
- `sync` {volumes, offered} + one {key} + fd message per offered descriptor -> one {key} + fd
  message per descriptor the plugin lacks, then {done, took_over, failed}; the connection then
  stays open until this process ends (the plugin's watch), and carries {op: given_up, key}
  when a volume's daemon keeps dying.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardfs.csi import wire
from shardfs.csi.mounter.volumes import ServeError, Volumes
from shardfs.csi.volume import VolumeSpec

log = logging.getLogger(__name__)


class MounterServer:
    def __init__(self, path: str, volumes: Volumes) -> None:
        self.path = path
        self.volumes = volumes
        self.sock = wire.listen(path)
        os.chmod(path, 0o600)  # the plugin is root; nobody else may hand us descriptors
        self._watchers: set[socket.socket] = set()  # the plugin's watch connections
        self._watchers_lock = threading.Lock()
        volumes.on_give_up = self._tell_given_up

    def _tell_given_up(self, key: str) -> None:
        with self._watchers_lock:
            watchers = list(self._watchers)
        for conn in watchers:
            with contextlib.suppress(OSError):
                wire.send(conn, {"op": "given_up", "key": key})

    def serve_forever(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed: stopping
            threading.Thread(target=self._handle, args=(conn,), daemon=True,
                             name="mounter-conn").start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            uid = wire.peer_uid(conn)
            if uid not in (0, os.getuid()):
                log.warning("refused a connection from uid %d", uid)
                return
            try:
                message, fds = wire.recv(conn)
            except (wire.WireError, OSError):
                return
            op = message.get("op")
            try:
                if op == "serve":
                    self._serve(conn, message, fds)
                elif op == "token":
                    _close_all(fds)
                    self._token(conn, message)
                elif op == "release":
                    _close_all(fds)
                    self.volumes.release(str(message["key"]))
                    wire.send(conn, {"ok": True})
                elif op == "sync":
                    _close_all(fds)
                    self._sync(conn, message)
                else:
                    _close_all(fds)
                    wire.send(conn, {"ok": False, "error": f"unknown request {op!r}"})
            except (wire.WireError, OSError, KeyError, TypeError, ValueError) as exc:
                log.warning("%s request failed: %s", op, exc)

    def _serve(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
        if len(fds) != 1:
            _close_all(fds)
            wire.send(conn, {"ok": False, "error": "serve needs exactly one descriptor"})
            return
        _answer(conn, str(message["key"]), lambda key: self.volumes.serve(
            key, VolumeSpec.from_json(message["spec"]), dict(message.get("secrets") or {}),
            str(message["node_path"]), fds[0], token=message.get("token")))

    def _token(self, conn: socket.socket, message: dict[str, Any]) -> None:
        _answer(conn, str(message["key"]),
                lambda key: self.volumes.renew_token(key, str(message["token"])))

    def _sync(self, conn: socket.socket, message: dict[str, Any]) -> None:
        known = dict(message.get("volumes") or {})
        offered: dict[str, int] = {}
        for _ in message.get("offered") or []:
            item, fds = wire.recv(conn)
            if fds:
                offered[str(item.get("key"))] = fds[0]
                _close_all(fds[1:])
        back, took_over, failed = self.volumes.sync(known, offered)
        for key, fd in back.items():
            wire.send(conn, {"key": key}, (fd,))
        wire.send(conn, {"done": True, "took_over": took_over, "failed": failed})
        log.info("synced with the plugin: %d volume(s), %d descriptor(s) handed back, "
                 "%d taken over, %d failed", len(known), len(back), len(took_over),
                 len(failed))
        # The plugin's watch: the connection lives as long as we do.
        with self._watchers_lock:
            self._watchers.add(conn)
        try:
            with contextlib.suppress(OSError, wire.WireError):
                wire.recv(conn)
        finally:
            with self._watchers_lock:
                self._watchers.discard(conn)


def _answer(conn: socket.socket, key: str, do: Callable[[str], None]) -> None:
    """Do a request for volume `key` and answer {ok}, or {ok: false, error, code}."""
    try:
        do(key)
    except ServeError as exc:
        log.warning("volume %s: %s", key, exc)
        wire.send(conn, {"ok": False, "error": str(exc), "code": exc.code})
        return
    wire.send(conn, {"ok": True})


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def run(args: argparse.Namespace) -> int:
    from shardfs.cli.logsetup import setup_logging
    from shardfs.cli.main import default_cache_size
    from shardfs.util.sizes import parse_size

    setup_logging(args.log_level)  # the daemon's format, signed URLs' signatures redacted
    try:
        path = wire.socket_path(args.listen)
        cache_root = Path(args.cache_root).resolve()
        cache_size = parse_size(args.cache_size) if args.cache_size else \
            default_cache_size(cache_root)
    except ValueError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        volumes = Volumes(Path(args.state_dir), cache_root, cache_size,
                          spares=not args.no_spares)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        server = MounterServer(path, volumes)
    except OSError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr, flush=True)
        return 1
    log.info("shardfs csi-mounter on %s, cache root %s (budget %d bytes), state %s", path,
             cache_root, cache_size, args.state_dir)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True, name="mounter-accept").start()
    stop.wait()
    log.info("stopping: the mounts stay, held by the plugin, for the next mounter")
    server.close()
    volumes.shutdown()
    return 0
