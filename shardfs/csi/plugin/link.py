"""The node plugin's side of the mounter socket.

Requests (`serve`, `release`) each use a connection of their own, so a volume that takes
minutes to index never holds up another. One more connection stays open for as long as the
mounter lives (the *watch*): on every (re)connection the plugin syncs — it hands the mounter
the FUSE descriptors of every mount it holds (a new mounter takes those mounts over) and gets
back those it lacks (after its own restart) — and when that connection closes, the mounter is
gone and the plugin connects again until a new one answers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from shardfs.csi import wire

log = logging.getLogger(__name__)

RECONNECT_S = 0.2


class MounterUnavailable(OSError):
    """No mounter answers on its socket (it is starting or restarting)."""


class Descriptors:
    """The FUSE descriptor of every mount this plugin holds, by volume key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}

    def put(self, key: str, fd: int) -> None:
        with self._lock:
            old = self._fds.pop(key, None)
            self._fds[key] = fd
        if old is not None and old != fd:
            os.close(old)

    def get(self, key: str) -> int | None:
        with self._lock:
            return self._fds.get(key)

    def drop(self, key: str) -> None:
        with self._lock:
            fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._fds)


class MounterLink:
    def __init__(self, address: str, descriptors: Descriptors,
                 known: Callable[[], dict[str, dict[str, Any]]],
                 given_up: Callable[[str], None]) -> None:
        self.path = wire.socket_path(address)
        self.descriptors = descriptors
        self._known = known  # key -> spec of every volume the plugin has
        self._given_up = given_up  # the mounter will not serve this volume any more
        self.synced = threading.Event()  # the first sync with a mounter is done
        self.syncs = 0
        self._stop = threading.Event()

    # -- requests ------------------------------------------------------------------------
    def request(self, message: dict[str, Any], fds: tuple[int, ...] = (),
                timeout: float | None = None) -> dict[str, Any]:
        try:
            sock = wire.connect(self.path, timeout=5.0)
        except OSError as exc:
            raise MounterUnavailable(f"the mounter does not answer on {self.path}: "
                                     f"{exc.strerror or exc}") from None
        with sock:
            sock.settimeout(timeout)
            wire.send(sock, message, fds)
            try:
                reply, extra = wire.recv(sock)
            except (wire.WireError, OSError) as exc:
                raise MounterUnavailable(f"the mounter went away during "
                                         f"{message.get('op')}: {exc}") from None
            for fd in extra:
                os.close(fd)
        return reply

    # -- the watch -----------------------------------------------------------------------
    def run(self) -> None:
        """Keep one connection to the mounter, syncing on each; until stop()."""
        said_waiting = False
        while not self._stop.is_set():
            try:
                sock = wire.connect(self.path, timeout=5.0)
            except OSError:
                if not said_waiting:
                    log.info("waiting for the mounter on %s", self.path)
                    said_waiting = True
                self._stop.wait(RECONNECT_S)
                continue
            said_waiting = False
            with sock:
                try:
                    self._sync(sock)
                    self.syncs += 1
                    self.synced.set()
                    sock.settimeout(None)
                    while True:  # until the mounter goes away (WireError)
                        message, fds = wire.recv(sock)
                        for fd in fds:
                            os.close(fd)
                        if message.get("op") == "given_up":
                            self._given_up(str(message.get("key")))
                except (wire.WireError, OSError) as exc:
                    if not self._stop.is_set():
                        log.warning("lost the mounter (%s); reconnecting", exc)

    def stop(self) -> None:
        self._stop.set()

    def _sync(self, sock: Any) -> None:
        known = self._known()
        held = self.descriptors.held()
        offered = [k for k in known if k in held]
        wire.send(sock, {"op": "sync", "volumes": known, "offered": offered})
        for key in offered:
            wire.send(sock, {"key": key}, (held[key],))
        while True:
            reply, fds = wire.recv(sock)
            if "key" in reply:
                if fds and reply["key"] in known:
                    self.descriptors.put(reply["key"], fds[0])
                    fds = fds[1:]
                for fd in fds:
                    os.close(fd)
                continue
            for key, error in (reply.get("failed") or {}).items():
                log.error("volume %s: the mounter cannot serve it: %s", key, error)
            if reply.get("took_over"):
                log.info("the mounter took over %d mount(s): %s", len(reply["took_over"]),
                         ", ".join(reply["took_over"]))
            return

