"""The mounter's volumes: a FUSE descriptor, a daemon serving it, and what restarts need.

```
STATE_DIR/volumes/KEY.json   spec, node path, secrets (0600, in a 0700 dir): what a new
                             mounter needs to start the volume's daemon again
STATE_DIR/volumes/KEY.yaml   the volume's settings, given to its daemon as --config
STATE_DIR/volumes/KEY.google.json  the secret GOOGLE_CREDENTIALS_JSON, if given (0600): the
                             file GOOGLE_APPLICATION_CREDENTIALS names to the daemon
STATE_DIR/volumes/KEY.token  a pod's service account token (authentication_source: pod;
                             0600), rewritten when kubelet republishes with a newer one: the
                             file AWS_WEB_IDENTITY_TOKEN_FILE names to the daemon, or the
                             subject token of KEY.google.json (csi/podidentity.py)
CACHE_ROOT/KEY/              the volume's cache dir (shards, indexes, tree, shardfs.log)
```
A daemon that dies while its volume is published is started again with `--takeover` (the
mounter still holds the descriptor); after DEATHS_LIMIT deaths in DEATHS_WINDOW_S it is left
dead and the reason logged. Released volumes' caches stay for a quick remount, pruned
least recently used first so that kept caches and live volumes' budgets fit the root budget.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shardfs.csi.mounter.daemon import Daemon, DaemonArgs, StartFailed
from shardfs.csi.volume import GOOGLE_CREDENTIALS_JSON, VolumeSpec, check_secrets

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0
SPARE_WAIT_S = 60.0  # a spare still importing when the daemon dies is waited for this long
DEATHS_LIMIT = 5
DEATHS_WINDOW_S = 60.0


class ServeError(Exception):
    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class Volume:
    key: str
    spec: VolumeSpec
    secrets: dict[str, str]
    node_path: str
    fd: int | None = None
    token: str | None = None  # the pod's service account token (spec.pod)
    daemon: Daemon | None = None
    spare: Daemon | None = None  # standing by to take over at once when the daemon dies
    released: bool = False
    deaths: deque[float] = field(default_factory=lambda: deque(maxlen=DEATHS_LIMIT))
    lock: threading.Lock = field(default_factory=threading.Lock)


class Volumes:
    def __init__(self, state_dir: Path, cache_root: Path, cache_size: int, *,
                 spares: bool = True) -> None:
        self.spares = spares
        self.state_dir = state_dir
        self.records = state_dir / "volumes"
        self.cache_root = cache_root
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.volumes: dict[str, Volume] = {}
        self.takeovers = 0
        self.on_give_up: Callable[[str], None] | None = None  # tells the plugin
        state_dir.mkdir(parents=True, exist_ok=True)
        self.records.mkdir(exist_ok=True)
        os.chmod(self.records, 0o700)
        cache_root.mkdir(parents=True, exist_ok=True)
        os.chmod(cache_root, 0o700)  # volumes' caches are theirs alone
        self._load()

    # -- records -------------------------------------------------------------------------
    def _load(self) -> None:
        """Volumes an earlier mounter served; their descriptors come with the plugin's sync."""
        for path in sorted(self.records.glob("*.json")):
            if path.name.endswith(".google.json"):
                continue  # a volume's credentials file, not a record
            try:
                data = json.loads(path.read_text())
                volume = Volume(path.stem, VolumeSpec.from_json(data["spec"]),
                                dict(data["secrets"]), data["node_path"],
                                token=data.get("token"))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("ignoring the unreadable record %s: %s", path, exc)
                continue
            self.volumes[volume.key] = volume
        if self.volumes:
            log.info("%d volume(s) served by an earlier mounter; waiting for the plugin's "
                     "descriptors", len(self.volumes))

    def _write_record(self, volume: Volume) -> None:
        data = {"spec": volume.spec.to_json(), "secrets": volume.secrets,
                "node_path": volume.node_path, "token": volume.token}
        _write_private(self.records / f"{volume.key}.json", json.dumps(data))
        _write_private(self.records / f"{volume.key}.yaml",
                       yaml.safe_dump(volume.spec.options) if volume.spec.options else "{}\n")

    def _daemon_secrets(self, volume: Volume) -> dict[str, str]:
        """The volume's secrets as its daemon's environment: a Google credentials file's
        content is written to a private file, which GOOGLE_APPLICATION_CREDENTIALS names (the
        variable Google's libraries and shardfs's gs:// read)."""
        secrets = dict(volume.secrets)
        google = secrets.pop(GOOGLE_CREDENTIALS_JSON, None)
        if google is not None:
            path = self.records / f"{volume.key}.google.json"
            _write_private(path, google)
            secrets["GOOGLE_APPLICATION_CREDENTIALS"] = str(path)
        pod = volume.spec.pod
        if pod is not None:
            # The credential chains read the token file again at each exchange.
            token_file = self._write_token(volume)
            google_file = self.records / f"{volume.key}.google.json"
            config = pod.google_config(str(token_file))
            if config is not None:
                _write_private(google_file, config)
            secrets.update(pod.daemon_env(str(token_file), str(google_file)))
        return secrets

    def _write_token(self, volume: Volume) -> Path:
        """The pod's token, where the volume's daemon reads it (KEY.token, 0600)."""
        path = self.records / f"{volume.key}.token"
        _write_private(path, volume.token or "")
        return path

    def renew_token(self, key: str, token: str) -> None:
        """A pod's newer token for a volume with pod-level credentials: kept in the record
        and in the file the daemon reads at its next STS call."""
        with self.lock:
            volume = self.volumes.get(key)
        if volume is None or volume.spec.pod is None:
            raise ServeError(f"no volume {key} with pod-level credentials here",
                             "NOT_FOUND")
        with volume.lock:
            if token == volume.token:
                return
            volume.token = token
            self._write_record(volume)
            self._write_token(volume)
        log.info("volume %s: a newer service account token from kubelet", key)

    def _drop_record(self, key: str) -> None:
        for suffix in (".json", ".yaml", ".google.json", ".token"):
            with contextlib.suppress(FileNotFoundError):
                (self.records / f"{key}{suffix}").unlink()

    # -- serving -------------------------------------------------------------------------
    def serve(self, key: str, spec: VolumeSpec, secrets: dict[str, str], node_path: str,
              fd: int, *, token: str | None = None) -> None:
        """A new mount from the plugin: start its daemon (it answers INIT) and wait until it
        is ready. The descriptor is ours from here on, also when this fails."""
        try:
            check_secrets(secrets)
        except ValueError as exc:
            os.close(fd)
            raise ServeError(str(exc), "INVALID_ARGUMENT") from None
        with self.lock:
            stale = self.volumes.get(key)
            if stale is not None and stale.daemon is not None and stale.daemon.alive():
                os.close(fd)  # the same volume again (a retried publish): already served
                return
        if stale is not None:  # a mount the plugin replaced (its daemon gave up, or none)
            with stale.lock:
                self._forget(stale)
        if spec.pod is not None and not token:
            os.close(fd)
            raise ServeError("authentication_source: pod, but no service account token came "
                             "with the volume", "INVALID_ARGUMENT")
        volume = Volume(key, spec, dict(secrets), node_path, fd=fd, token=token)
        with self.lock:
            self.volumes[key] = volume
        with volume.lock:
            try:
                self._write_record(volume)
                self._start(volume, takeover=False)
            except BaseException:
                self._forget(volume)
                raise

    def take_over(self, key: str, fd: int) -> None:
        """After our restart: the plugin hands back a live, initialised mount."""
        with self.lock:
            volume = self.volumes.get(key)
        if volume is None:
            os.close(fd)
            raise ServeError(f"no record of volume {key} in {self.records}")
        with volume.lock:
            if volume.fd is not None:
                os.close(fd)
                return
            volume.fd = fd
            self.takeovers += 1
            self._start(volume, takeover=True)

    def _budget(self, spec: VolumeSpec) -> int:
        size = spec.options.get("cache_size")
        if size is None:
            return self.cache_size
        if size > self.cache_size:
            raise ServeError(f"volumeAttributes: cache_size {size} is larger than the "
                             f"mounter's cache root budget ({self.cache_size} bytes)",
                             "INVALID_ARGUMENT")
        return size

    def _daemon_args(self, volume: Volume, *, takeover: bool) -> DaemonArgs:
        assert volume.fd is not None
        options = {k: v for k, v in volume.spec.options.items() if k != "cache_size"}
        return DaemonArgs(
            sources=volume.spec.sources, node_path=volume.node_path, fuse_fd=volume.fd,
            cache_dir=self.cache_root / volume.key, cache_size=self._budget(volume.spec),
            config_file=(self.records / f"{volume.key}.yaml") if options else None,
            gid=volume.spec.gid, takeover=takeover)

    def _start(self, volume: Volume, *, takeover: bool) -> None:
        """Start the volume's daemon (or wake its spare) and wait until it serves."""
        spare, volume.spare = volume.spare, None
        # A spare still importing is nearer to serving than a new process: wait for it.
        if takeover and spare is not None and spare.alive() and \
                spare.standing_by.wait(SPARE_WAIT_S) and spare.alive():
            spare.go()
            daemon, how = spare, "took over the mount (a spare)"
        else:
            if spare is not None:
                spare.dismiss()
            self._prune(keep=volume.key)
            daemon = Daemon(self._daemon_args(volume, takeover=takeover),
                            self._daemon_secrets(volume))
            how = "took over the mount" if takeover else "serves the mount"
        try:
            summary = daemon.wait_ready(READY_TIMEOUT_S)
        except StartFailed as exc:
            raise ServeError(str(exc)) from None
        volume.daemon = daemon
        log.info("volume %s: daemon %d %s (%s)", volume.key, daemon.pid, how, summary)
        threading.Thread(target=self._supervise, args=(volume, daemon), daemon=True,
                         name=f"supervise-{volume.key}").start()
        if self.spares:
            self._start_spare(volume)

    def _start_spare(self, volume: Volume) -> None:
        """A daemon that imports everything and waits, so that a death costs a takeover,
        not a start: the holder's spare (issue 25), one per volume."""
        spare = Daemon(self._daemon_args(volume, takeover=True), self._daemon_secrets(volume),
                       standby=True)
        volume.spare = spare

        def stand_by() -> None:
            if spare.wait_standby(READY_TIMEOUT_S):
                log.info("volume %s: spare daemon %d stands by", volume.key, spare.pid)
            elif spare.alive() or spare.proc.returncode not in (None, 0):
                log.warning("volume %s: the spare daemon %d did not stand by", volume.key,
                            spare.pid)

        threading.Thread(target=stand_by, daemon=True, name=f"spare-{volume.key}").start()

    def _supervise(self, volume: Volume, daemon: Daemon) -> None:
        code = daemon.wait()
        with volume.lock:
            if volume.released or volume.daemon is not daemon:
                return
            volume.daemon = None
            now = time.monotonic()
            volume.deaths.append(now)
            how = f"signal {-code}" if code < 0 else f"status {code}"
            if len(volume.deaths) == DEATHS_LIMIT and now - volume.deaths[0] < DEATHS_WINDOW_S:
                log.error("volume %s: the daemon died %d times in %.0f s (last: %s); not "
                          "starting it again: the mount is given up", volume.key,
                          DEATHS_LIMIT, now - volume.deaths[0], how)
                self._give_up(volume)
                return
            log.warning("volume %s: the daemon %d ended (%s) while the volume is published; "
                        "starting a new one on the same mount", volume.key, daemon.pid, how)
            try:
                self._start(volume, takeover=True)
            except ServeError as exc:
                log.error("volume %s: the new daemon failed: %s; the mount is given up",
                          volume.key, exc)
                self._give_up(volume)

    @staticmethod
    def _let_go(volume: Volume) -> None:
        """Dismiss the volume's spare daemon and close our copy of its FUSE descriptor."""
        if volume.spare is not None:
            volume.spare.dismiss()
            volume.spare = None
        if volume.fd is not None:
            os.close(volume.fd)
            volume.fd = None

    def _give_up(self, volume: Volume) -> None:
        """Nobody will serve this mount: close our descriptor and tell the plugin, which
        closes its own; with no descriptor left the kernel ends the connection, so readers
        get an error (ENOTCONN) instead of waiting forever. Unpublish cleans up as usual."""
        self._let_go(volume)
        if self.on_give_up is not None:
            self.on_give_up(volume.key)

    # -- release -------------------------------------------------------------------------
    def release(self, key: str) -> None:
        with self.lock:
            volume = self.volumes.pop(key, None)
        if volume is None:
            return
        with volume.lock:
            self._forget(volume)
        log.info("volume %s released", key)

    def _forget(self, volume: Volume) -> None:
        """Close our descriptor (the plugin unmounted already), end the daemon, drop the
        record; the cache stays, marked as used now."""
        volume.released = True
        self._let_go(volume)
        if volume.daemon is not None:
            volume.daemon.stop()
            volume.daemon = None
        with self.lock:
            if self.volumes.get(volume.key) is volume:
                del self.volumes[volume.key]
        self._drop_record(volume.key)
        cache = self.cache_root / volume.key
        with contextlib.suppress(OSError):
            os.utime(cache)

    def _prune(self, keep: str) -> None:
        """Remove released volumes' caches, oldest first, while kept caches and the live
        volumes' budgets exceed the root budget."""
        with self.lock:
            live = {k: v for k, v in self.volumes.items() if not v.released}
        committed = sum(self._budget_or_root(v.spec) for v in live.values())
        kept = []
        for path in self.cache_root.iterdir():
            if path.is_dir() and path.name not in live and path.name != keep:
                kept.append((path.stat().st_mtime, path, _disk_use(path)))
        kept.sort()
        total = committed + sum(size for _, _, size in kept)
        for _, path, size in kept:
            if total <= self.cache_size:
                break
            log.info("removing the cache of released volume %s (%d bytes)", path.name, size)
            shutil.rmtree(path, ignore_errors=True)
            total -= size

    def _budget_or_root(self, spec: VolumeSpec) -> int:
        return min(spec.options.get("cache_size") or self.cache_size, self.cache_size)

    # -- the plugin's sync ---------------------------------------------------------------
    def sync(self, known: dict[str, Any], offered: dict[str, int]
             ) -> tuple[dict[str, int], list[str], dict[str, str]]:
        """The plugin lists every volume it has and hands the descriptors it holds. Returns
        (descriptors it lacks, keys taken over, failures). Volumes it does not list are
        released: the plugin is the authority on what is published."""
        back: dict[str, int] = {}
        took_over: list[str] = []
        failed: dict[str, str] = {}
        with self.lock:
            ours = dict(self.volumes)
        for key in set(ours) - set(known):
            log.info("volume %s: the plugin no longer has it; releasing", key)
            self.release(key)
        for key in known:
            volume = ours.get(key)
            fd = offered.pop(key, None)
            if volume is not None and volume.fd is not None:
                if fd is not None:
                    os.close(fd)
                elif volume.fd is not None:
                    back[key] = volume.fd
                continue
            if fd is None:
                failed[key] = "neither the plugin nor the mounter holds its descriptor " \
                              "(both restarted?): the mount is lost"
                continue
            try:
                self.take_over(key, fd)
                took_over.append(key)
            except ServeError as exc:
                failed[key] = str(exc)
        for fd in offered.values():
            os.close(fd)
        return back, took_over, failed

    def shutdown(self) -> None:
        """We are stopping (an upgrade): the daemons end with us, the mounts stay (the
        plugin holds them) for the next mounter to take over."""
        with self.lock:
            volumes = list(self.volumes.values())
        for volume in volumes:
            volume.released = True  # no restart by the supervisor
            for daemon in (volume.spare, volume.daemon):
                if daemon is not None:
                    daemon.kill()


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _disk_use(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total
