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

from shardfs.cli.daemonize import READY_PREFIX, STANDBY_LINE
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

    def argv(self, ready_fd: int, standby_fd: int | None = None) -> list[str]:
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
        if standby_fd is not None:
            argv += ["--standby-fd", str(standby_fd)]
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
    """A started daemon process; `wait_ready()` once, then `wait()` / `stop()`.

    A *spare* (`standby=True`, always a takeover) imports everything, says STANDBY and waits
    on its standby pipe: `go()` makes it take the mount over at once (then `wait_ready()`),
    `dismiss()` lets it exit. It opens the cache dir only after "go"."""

    def __init__(self, args: DaemonArgs, secrets: Mapping[str, str], *,
                 standby: bool = False) -> None:
        self.args = args
        read_end, write_end = os.pipe()
        standby_r, self._standby_w = os.pipe() if standby else (None, None)
        passed = (args.fuse_fd, write_end, *((standby_r,) if standby_r is not None else ()))
        try:
            self.proc = subprocess.Popen(
                args.argv(write_end, standby_r), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=passed,
                env=daemon_env(secrets), start_new_session=True, cwd="/")
        except BaseException:
            os.close(read_end)
            if self._standby_w is not None:
                os.close(self._standby_w)
            raise
        finally:
            os.close(write_end)
            if standby_r is not None:
                os.close(standby_r)
        self.pid = self.proc.pid
        self._ready_fd = read_end
        self._ready_lock = threading.Lock()
        self._pending = b""
        self.standing_by = threading.Event()  # a spare that said STANDBY
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

    def _read_line(self, deadline: float) -> str | None:
        """The next line on the ready pipe; "" at its end; None past the deadline. One
        reader at a time, and the pipe is closed only when no one reads it (`_ready_lock`),
        so that a descriptor number is never read after it was closed and reused."""
        with self._ready_lock:
            if self._ready_fd < 0:
                return ""
            return self._read_line_locked(deadline)

    def _read_line_locked(self, deadline: float) -> str | None:
        os.set_blocking(self._ready_fd, False)
        while b"\n" not in self._pending:
            if time.monotonic() > deadline:
                return None
            try:
                chunk = os.read(self._ready_fd, 4096)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            if not chunk:
                break
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(errors="replace") + ("\n" if _ else "")

    def wait_standby(self, timeout: float) -> bool:
        """A spare: True once it stands by (imported, waiting for "go")."""
        line = self._read_line(time.monotonic() + timeout)
        if line == STANDBY_LINE:
            self.standing_by.set()
            return True
        return False

    def go(self) -> None:
        assert self._standby_w is not None
        os.write(self._standby_w, b"go\n")
        os.close(self._standby_w)
        self._standby_w = None

    def dismiss(self) -> None:
        """A spare that is not needed: standing by, it exits when its standby pipe closes;
        still starting, it is killed (it has touched nothing yet)."""
        if self._standby_w is not None:
            os.close(self._standby_w)
            self._standby_w = None
        if not self.standing_by.is_set():
            self.kill()  # its stand-by reader sees the pipe's end and lets go of it
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_ready()

    def _close_ready(self) -> None:
        with self._ready_lock:
            if self._ready_fd >= 0:
                os.close(self._ready_fd)
                self._ready_fd = -1

    def wait_ready(self, timeout: float) -> str:
        """The daemon's READY summary; StartFailed with its error line otherwise."""
        try:
            text = self._read_line(time.monotonic() + timeout)
        finally:
            self._close_ready()
        if text is None:
            self.kill()
            raise StartFailed(f"the daemon was not ready within {timeout:.0f} s")
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
