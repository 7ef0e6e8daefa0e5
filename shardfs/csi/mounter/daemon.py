"""One volume's shardfs daemon, run by the mounter on a FUSE descriptor it was handed.

`shardfs mount SOURCE... NODE_PATH --foreground --fuse-fd N --ready-fd W` (plus `--takeover`
when the connection was already initialised by an earlier daemon), in its own session and
process group, with the volume's secrets in its environment only. Until it is ready its
stderr comes here (the `shardfs: error:` line is the failure's message); from then on it
logs to shardfs.log in its cache dir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardfs.cli.daemonize import READY_PREFIX
from shardfs.csi.volume import SECRET_KEYS

log = logging.getLogger(__name__)

STOP_S = 10.0  # a daemon whose mount is gone ends by itself well within this


@dataclass(frozen=True, slots=True)
class DaemonArgs:
    sources: list[str]
    node_path: str
    fuse_fd: int
    cache_dir: Path
    cache_size: int
    config_file: Path | None
    gid: int | None
    takeover: bool

    def argv(self, ready_fd: int) -> list[str]:
        argv = [sys.executable, "-m", "shardfs", "mount", *self.sources, self.node_path,
                "--foreground", "--fuse-fd", str(self.fuse_fd), "--ready-fd", str(ready_fd),
                "--cache-dir", str(self.cache_dir), "--cache-size", str(self.cache_size),
                "--allow-other"]
        if self.config_file is not None:
            argv += ["--config", str(self.config_file)]
        if self.gid is not None:
            argv += ["--gid", str(self.gid)]
        if self.takeover:
            argv.append("--takeover")
        return argv


class StartFailed(Exception):
    """The daemon ended (or never got ready); the message is its `shardfs: error:` line."""


# The mounter's own supervisor's variables (systemd, a shardfs holder): the daemon must not
# report to them or hand them its connection; the mounter is its keeper.
_NOT_INHERITED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                  "LISTEN_FDNAMES", "FDSTORE", "SHARDFS_FDSTORE", "SHARDFS_HOLDER_FD",
                  "SHARDFS_HOLDER_PID")


def daemon_env(secrets: Mapping[str, str]) -> dict[str, str]:
    """The mounter's environment without any secret of ours or its supervisor's variables,
    plus this volume's secrets."""
    env = {k: v for k, v in os.environ.items()
           if k not in SECRET_KEYS and k not in _NOT_INHERITED}
    if any(k.startswith("AWS_") for k in secrets):
        env.pop("AWS_PROFILE", None)  # a profile would make the SDK chain skip the keys
    env.update(secrets)
    return env


class Daemon:
    """A started daemon process; `wait_ready()` once, then `wait()` / `stop()`."""

    def __init__(self, args: DaemonArgs, secrets: Mapping[str, str]) -> None:
        self.args = args
        read_end, write_end = os.pipe()
        try:
            self.proc = subprocess.Popen(
                args.argv(write_end), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, pass_fds=(args.fuse_fd, write_end),
                env=daemon_env(secrets), start_new_session=True, cwd="/")
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self.pid = self.proc.pid
        self._ready_fd = read_end
        self._output: list[str] = []
        self._reader = threading.Thread(target=self._collect, daemon=True,
                                        name=f"daemon-{self.pid}-out")
        self._reader.start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:  # ends when the daemon hands its stderr to its log
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line:
                self._output.append(line)
                del self._output[:-50]

    def wait_ready(self, timeout: float) -> str:
        """The daemon's READY summary; StartFailed with its error line otherwise."""
        data = b""
        deadline = time.monotonic() + timeout
        try:
            os.set_blocking(self._ready_fd, False)
            while b"\n" not in data:
                if time.monotonic() > deadline:
                    self.kill()
                    raise StartFailed(f"the daemon was not ready within {timeout:.0f} s")
                try:
                    chunk = os.read(self._ready_fd, 4096)
                except BlockingIOError:
                    time.sleep(0.02)
                    continue
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(self._ready_fd)
        text = data.decode(errors="replace")
        if text.startswith(READY_PREFIX):
            return text[len(READY_PREFIX):].strip()
        code = self.proc.wait()
        self._reader.join(5)
        errors = [line for line in self._output if line.startswith("shardfs: error:")]
        if errors:
            raise StartFailed(errors[-1])
        tail = "; ".join(self._output[-3:])
        raise StartFailed(f"shardfs: error: the daemon exited with status {code}"
                          + (f": {tail}" if tail else ""))

    def wait(self) -> int:
        return self.proc.wait()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """After the mount is gone the daemon ends by itself; make sure of it."""
        try:
            self.proc.wait(STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the daemon and its workers (its process group): the mount stays, held by
        the plugin, for a successor to take over."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            self.proc.wait()
